"""CPU offload (`cpu_offload=True` of `parallelize_hsdp` / `parallelize_fsdp`): FSDP2's offload policy on
every unit, the same numbers as without it (on CPU there is nothing to copy, so bit-identical), and
`fsdp_parameters` telling the host-resident parameters from the device-resident ones."""

import pytest
import torch
from _tiny_transformer import TinyConfig, TinyTransformer
from _train_compare import assert_same_run, parallel_run, reference_and_parallel_run
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ParallelizeError,
    fsdp_parameters,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
)

FSDP2 = MeshConfig(data_parallel_shard=2)
HSDP2x2 = MeshConfig(data_parallel_replicate=2, data_parallel_shard=2)


def _hsdp_offload(model, ctx):
    parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), cpu_offload=True)


def _hsdp(model, ctx):
    parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _fsdp_offload(model, ctx):
    parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), cpu_offload=True)


@pytest.mark.parametrize(("name", "config"), [("fsdp2", FSDP2), ("hsdp2x2", HSDP2x2)])
def test_offloaded_hsdp_matches_one_process_and_equals_no_offload_bit_for_bit(name, config):
    reference, offloaded = run_distributed(
        reference_and_parallel_run, config.world_size, config, _hsdp_offload, meta_init=True
    )[0]
    assert_same_run(offloaded, reference, rtol=1e-4, atol=1e-5)
    plain = run_distributed(parallel_run, config.world_size, config, _hsdp, meta_init=True)[0]
    assert offloaded.losses == plain.losses and offloaded.grad_norms == plain.grad_norms
    assert all(torch.equal(offloaded.params[k], v) for k, v in plain.params.items())


def test_offloaded_fsdp_with_gradient_accumulation_matches_one_process():
    """Accumulated sharded gradients are added on the host (FSDP2's offload path for a second microbatch)."""
    reference, got = run_distributed(
        reference_and_parallel_run, 2, FSDP2, _fsdp_offload, microbatches=2, meta_init=True
    )[0]
    assert_same_run(got, reference, rtol=1e-4, atol=1e-5)


def _units_and_split(config: MeshConfig, offload: bool) -> tuple[int, int, int, int, int]:
    """(FSDP units, units with CPUOffloadPolicy, parameters, offloaded, device-resident) of the tiny model."""
    with DistributedContext.from_env(config) as ctx:
        with torch.device("meta"):
            model = TinyTransformer(TinyConfig())
        parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), cpu_offload=offload)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        policies = [fully_shard.state(m)._fsdp_param_group.offload_policy for m in units]
        n = len(list(model.parameters()))
        host, device = fsdp_parameters(model, offloaded=True), fsdp_parameters(model, offloaded=False)
        return len(units), sum(isinstance(p, CPUOffloadPolicy) for p in policies), n, len(host), len(device)


def test_fsdp_parameters_splits_the_parameters_by_their_units_offload_policy():
    units, offloading, n, host, device = run_distributed(_units_and_split, 2, FSDP2, True)[0]
    assert units == offloading == TinyConfig().n_layers + 1 and host == n and device == 0
    units, offloading, n, host, device = run_distributed(_units_and_split, 2, FSDP2, False)[0]
    assert offloading == 0 and host == 0 and device == n


def _pinned_is_cuda_only(config: MeshConfig) -> bool:
    with DistributedContext.from_env(config) as ctx:
        model = TinyTransformer(TinyConfig())
        parallelize_fsdp(model, ctx.mesh("dense"), cpu_offload=True)
        policy = fully_shard.state(model)._fsdp_param_group.offload_policy
        return policy.pin_memory


def test_host_memory_is_pinned_only_where_there_is_a_device_to_copy_from():
    assert run_distributed(_pinned_is_cuda_only, 2, FSDP2) == [False, False]  # a CPU mesh: nothing to pin for


def _refused(config: MeshConfig, how: str) -> str:
    with DistributedContext.from_env(config) as ctx:
        model = TinyTransformer(TinyConfig())
        try:
            if how == "replicate":
                parallelize_hsdp(model, ctx.mesh("dense"), cpu_offload=True)
            else:
                parallelize_fsdp(model, None, cpu_offload=True)
        except ParallelizeError as exc:
            return str(exc)
        return "no error"


def test_offload_without_a_shard_axis_is_refused():
    found = run_distributed(_refused, 2, MeshConfig(data_parallel_replicate=2), "replicate")[0]
    assert "parallelize_hsdp: cpu_offload=True needs a shard axis larger than 1" in found
    found = run_distributed(_refused, 1, MeshConfig(), "none")[0]
    assert "parallelize_fsdp: cpu_offload=True needs a shard axis" in found


def test_replicate_takes_no_offload():
    """DDP keeps full replicas: there is no `cpu_offload` to pass (the trainer refuses it for such a mesh)."""
    import inspect

    assert "cpu_offload" not in inspect.signature(parallelize_replicate).parameters
