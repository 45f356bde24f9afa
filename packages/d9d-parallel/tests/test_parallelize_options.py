import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import make_batches, make_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ParallelizeError,
    apply_activation_checkpointing,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
)


def _cp_placements(config: MeshConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """The mesh every parameter lands on under parallelize_hsdp/replicate with a cp axis."""
    with DistributedContext.from_env(config) as ctx:
        dense = ctx.mesh("dense")
        found = {}
        for name, call in {
            "hsdp": lambda m: parallelize_hsdp(m, dense),
            "replicate": lambda m: parallelize_replicate(m, dense),
        }.items():
            model = call(make_model())
            meshes = {(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.shape)) for p in model.parameters()}
            assert len(meshes) == 1 and all(isinstance(p, DTensor) for p in model.parameters())
            found[name] = meshes.pop()
        return found


@pytest.mark.parametrize(
    ("config", "hsdp", "replicate"),
    [
        (MeshConfig(context_parallel=2), (("cp",), (2,)), (("cp",), (2,))),
        (
            MeshConfig(data_parallel_shard=2, context_parallel=2),
            (("dp_shard_cp",), (4,)),
            (("dp_shard_cp",), (4,)),
        ),
        (
            MeshConfig(data_parallel_replicate=2, context_parallel=2),
            (("dp_replicate", "cp"), (2, 2)),
            (("dp_replicate_cp",), (4,)),
        ),
    ],
    ids=["cp2", "dps2-cp2", "dpr2-cp2"],
)
def test_context_parallel_ranks_shard_parameters_with_dp_shard(config, hsdp, replicate):
    """cp ranks hold different tokens: their gradients are summed like dp's, and FSDP shards over
    dp_shard × cp (so cp does not multiply parameter memory); the replicate axes stay replicas."""
    found = run_distributed(_cp_placements, config.world_size, config)[0]
    assert found == {"hsdp": hsdp, "replicate": replicate}


def _bad_arguments():
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = make_model()
    unchanged = parallelize_hsdp(model, mesh)  # one data-parallel rank: nothing to do
    assert unchanged is model and not any(isinstance(p, DTensor) for p in model.parameters())
    with pytest.raises(ParallelizeError, match="shard_axis 'dp'"):
        parallelize_hsdp(model, mesh, shard_axis="dp")
    with pytest.raises(ParallelizeError, match="not axes of the mesh"):
        parallelize_fsdp(model, mesh, axes=["tp"])
    with pytest.raises(ParallelizeError, match="gradient_reduction"):
        parallelize_replicate(model, mesh, gradient_reduction="avg")
    with pytest.raises(ParallelizeError, match="no axis names"):
        parallelize_fsdp(model, init_device_mesh("cpu", (1,)))
    return True


def test_size_one_mesh_is_a_no_op_and_bad_arguments_are_named_1_rank():
    assert run_distributed(_bad_arguments, 1) == [True]


def _mixed_precision():
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        tokens = make_batches(1, 4, 8)[0]
        reference = make_model()
        ref_loss = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        model = make_model()
        parallelize_fsdp(model, ctx.mesh("dense"), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        seen = []
        model.blocks[0].attn.q.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
        rows = tokens[2 * ctx.rank : 2 * ctx.rank + 2]
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / 32
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        grad = model.blocks[0].attn.q.weight.grad
        return (
            seen,
            logits.dtype,
            float(total),
            float(ref_loss),
            grad.dtype,
            model.blocks[0].attn.q.weight.dtype,
        )


def test_fsdp2_mixed_precision_computes_in_bf16_keeps_fp32_state():
    seen, logits_dtype, loss, ref_loss, grad_dtype, param_dtype = run_distributed(_mixed_precision, 2)[0]
    assert seen == [torch.bfloat16] and logits_dtype == torch.bfloat16
    assert grad_dtype == torch.float32 and param_dtype == torch.float32
    assert loss == pytest.approx(ref_loss, rel=2e-2)


def test_activation_checkpointing_recomputes_and_keeps_gradients_and_names():
    tokens = make_batches(1, 2, 8)[0]
    plain, checkpointed = make_model(), make_model()
    apply_activation_checkpointing(checkpointed.blocks)
    apply_activation_checkpointing(checkpointed.blocks)  # idempotent
    calls = []
    checkpointed.blocks[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    for model in (plain, checkpointed):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert len(calls) == 2  # forward, then the recomputation in backward
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
