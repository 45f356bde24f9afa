"""Shared by the fault tests: the uninterrupted reference run that every faulted run must equal."""

import pytest
from faults._harness import STEPS, job_args, losses, start_job


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[float]]:
    """Exported weights and per-step losses of the uninterrupted tiny quickstart run of STEPS steps."""
    root = tmp_path_factory.mktemp("reference")
    job = start_job(job_args(root, "ref", STEPS), root / "ref.log")
    assert job.wait() == 0, job.output()[-3000:]
    return (root / "ref-export" / "model.safetensors").read_bytes(), losses(root / "ref")
