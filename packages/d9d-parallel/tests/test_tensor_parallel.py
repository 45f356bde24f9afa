import functools

import pytest
from _tiny_transformer import tiny_plan
from _train_compare import assert_same_run, reference_and_parallel_run

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_fsdp, parallelize_hsdp, parallelize_tensor_parallel


def _tp(model, ctx, *, fsdp=False, **plan_options):
    parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan(**plan_options))
    if fsdp:
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _compare(config, parallelize, **kwargs):
    results = run_distributed(reference_and_parallel_run, config.world_size, config, parallelize, **kwargs)
    reference, got = results[0]
    assert_same_run(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("sequence_parallel", "loss_parallel"), [(True, True), (False, True), (False, False)]
)
def test_tp2_matches_one_process(sequence_parallel, loss_parallel):
    parallelize = functools.partial(_tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    _compare(MeshConfig(tensor_parallel=2), parallelize)


@pytest.mark.parametrize("meta_init", [False, True])
def test_fsdp2_x_tp2_matches_one_process(meta_init):
    config = MeshConfig(data_parallel_shard=2, tensor_parallel=2)
    _compare(config, functools.partial(_tp, fsdp=True), meta_init=meta_init)


def _tp_then_hsdp(model, ctx):
    parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())
    parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def test_ddp2_x_tp2_through_hsdp_call_matches_one_process():
    _compare(MeshConfig(data_parallel_replicate=2, tensor_parallel=2), _tp_then_hsdp)


def _embedding_gradient(config: MeshConfig) -> dict:
    """One backward of the tiny model, built on meta and materialized (to_empty replaces DTensor
    parameters, and their hooks); what the vocab-parallel embedding's gradient looks like."""
    import torch
    import torch.nn.functional as F
    from _tiny_transformer import make_batches, make_model
    from torch.distributed.tensor import distribute_tensor

    from d9d.mesh import DistributedContext

    reference = make_model()
    with torch.device("meta"):
        model = make_model()
    with DistributedContext.from_env(config) as ctx:
        parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan(loss_parallel=False))
        model.to_empty(device="cpu")
        with torch.no_grad():  # the reference's weights, each rank its part
            for name, param in model.named_parameters():
                full = reference.get_parameter(name)
                param.to_local().copy_(
                    distribute_tensor(full, param.device_mesh, param.placements).to_local()
                )
        batch = make_batches(1, 2, 16)[0]
        for net in (reference, model):
            F.cross_entropy(net(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        grad = model.embed.weight.grad
        return {
            "placements": [repr(p) for p in grad.placements],
            "local_shape": tuple(grad.to_local().shape),
            "param_local_shape": tuple(model.embed.weight.to_local().shape),
            "max_diff": (grad.full_tensor() - reference.embed.weight.grad).abs().max().item(),
        }


def test_the_vocab_parallel_embeddings_gradient_stays_split_like_its_table():
    # DTensor's embedding backward gives the table's gradient replicated: at a 128k x 4096 vocabulary,
    # 2 GB of fp32 per tp rank held until the optimizer step
    for got in run_distributed(_embedding_gradient, 2, MeshConfig(tensor_parallel=2)):
        assert got["placements"] == ["Shard(dim=0)"], got
        assert got["local_shape"] == got["param_local_shape"], got
        assert got["max_diff"] <= 1e-6, got
