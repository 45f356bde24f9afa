"""The quickstart job under real torchrun launches gives the single-process losses on every mesh."""

import pytest
from _quickstart import MOE, losses, overrides, run_local, run_ranks

pytestmark = pytest.mark.slow

STEPS = 4
MESHES = {
    "ddp2": (2, ["mesh.data_parallel_replicate=2"]),
    "fsdp2": (2, ["mesh.data_parallel_shard=2"]),
    "hsdp2x2": (4, ["mesh.data_parallel_replicate=2", "mesh.data_parallel_shard=2"]),
    "tp2": (2, ["mesh.tensor_parallel=2"]),
    "fsdp2_tp2": (4, ["mesh.data_parallel_shard=2", "mesh.tensor_parallel=2"]),
    "pp2_1f1b": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
    "pp2_gpipe_fsdp2": (
        4,
        ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2", "pipelining.schedule=gpipe"],
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(runs):
    result = run_local(overrides(runs, "single", STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    ref = losses(runs, "single")
    assert len(ref) == STEPS and ref[-1] < ref[0]
    return ref


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_gives_single_process_losses(runs, reference, name):
    nproc, mesh = MESHES[name]
    run_ranks(nproc, overrides(runs, name, STEPS, *mesh))
    assert losses(runs, name) == pytest.approx(reference, rel=2e-4)


def test_expert_parallel_moe_gives_single_process_losses(runs):
    result = run_local(overrides(runs, "moe_single", STEPS, *MOE))
    assert result.returncode == 0, result.stderr[-3000:]
    run_ranks(
        2, overrides(runs, "moe_ep2", STEPS, *MOE, "mesh.data_parallel_shard=2", "mesh.expert_parallel=2")
    )
    assert losses(runs, "moe_ep2") == pytest.approx(losses(runs, "moe_single"), rel=2e-4)
