"""Degrees the model cannot honour are refused before anything is written, on real gloo ranks."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.trainer import Trainer


def _build(config: dict) -> None:
    with Trainer.from_config(config):
        pass


@pytest.mark.parametrize(
    ("mesh", "key"),
    [({"tensor_parallel": 2}, "tensor_parallel"), ({"expert_parallel": 2, "data_parallel_shard": 2}, None)],
    ids=["tp2-without-tp", "ep2-dense-model"],
)
def test_a_degree_the_provider_did_not_apply_is_one_error_and_nothing_is_written(tmp_path, mesh, key):
    """The tiny provider applies only HSDP: tp 2 would run as redundant copies of one model."""
    config = job_config(str(tmp_path), mesh=mesh)
    if key is None:  # ep 2 on a dense model: nothing to split over experts, HSDP is applied: accepted
        run_distributed(_build, 2, config, timeout=120)
        return
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_build, 2, config, timeout=120)
    message = str(failure.value)
    assert f"mesh.{key}=2 but the model provider's parallelize_model_stage left no parameter" in message
    assert f"set mesh.{key}: 1" in message
    assert not (tmp_path / "tiny").exists()
