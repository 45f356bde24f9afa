"""Shared fixtures: one tiny trained run (4 steps, checkpoints at 2 and 4) for the read-only commands."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import write_job

from d9d.cli import cli


@dataclass(frozen=True)
class TinyRun:
    """A trained tiny job: its config (next to tiny_job.py) and its run directory."""

    root: Path
    config: Path
    run_dir: Path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    root = tmp_path_factory.mktemp("tiny")
    config = write_job(root / "job")
    save_dir = root / "runs"
    result = CliRunner().invoke(
        cli, ["train", str(config), "--set", f"trainer.checkpointing.save_dir={save_dir}"]
    )
    assert result.exit_code == 0, result.output
    return TinyRun(root=root, config=config, run_dir=save_dir / "tiny")


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()
