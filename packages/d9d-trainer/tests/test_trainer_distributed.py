"""The same job on several meshes (real gloo processes) gives the single-process losses and weights."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer


def _run(config):
    with Trainer.from_config(config) as trainer:
        result = trainer.train()
        state = {}
        for key, value in trainer.model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            state[key] = full.detach().clone()
    return result.losses, state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(job_config(str(tmp_path_factory.mktemp("ref")), total_steps=4))


@pytest.mark.parametrize(
    "mesh",
    [
        {"data_parallel_replicate": 2},
        {"data_parallel_shard": 2},
        {"data_parallel_replicate": 2, "data_parallel_shard": 2},
    ],
    ids=["ddp2", "fsdp2", "hsdp2x2"],
)
def test_mesh_matches_single_process(tmp_path, reference, mesh):
    world = 1
    for degree in mesh.values():
        world *= degree
    ref_losses, ref_state = reference
    results = run_distributed(_run, world, job_config(str(tmp_path), total_steps=4, mesh=mesh), timeout=120)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=key)
