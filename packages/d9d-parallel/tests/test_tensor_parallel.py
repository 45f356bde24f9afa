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
