"""A Hugging Face model with attention dropout, SIGKILLed after a checkpoint and resumed, trains to the
uninterrupted run bit for bit (losses, grad norms, lr, exported weights): the resume restores the RNG
state that draws the dropout masks. Real processes, forked from here (tests/faults/_harness.py)."""

import sys
from pathlib import Path

import yaml
from _quickstart import RunResult, compare_runs
from faults._harness import kill_after_save_and_resume, start_job

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, save_tiny

import d9d.trainer.hf  # noqa: F401  # imported once here, not in every forked job

STEPS = 8
#: The killed run holds at the start of step 5, after save-4 (its steps take milliseconds).
HOLD = {"D9D_TEST_HANG_AT_STEP": "5"}


def _job(tmp_path: Path, folder: Path, name: str) -> Path:
    """The job file of a run named `name` (checkpoints every 2 steps, export to export-<name>)."""
    config = hf_job(
        folder,
        tmp_path / "runs",
        name=name,
        steps=STEPS,
        trainer={
            "checkpointing": {"save_dir": str(tmp_path / "runs"), "period_steps": 2},
            "logging": {"period_steps": 1, "progress_bar": False},
        },
        export={"dir": str(tmp_path / f"export-{name}")},
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _trained(tmp_path: Path, name: str) -> RunResult:
    return RunResult.read(tmp_path / "runs" / name, tmp_path / f"export-{name}")


def test_killed_run_with_attention_dropout_resumes_bit_exact(tmp_path):
    dropout = save_tiny("llama", tmp_path / "dropout", config={"attention_dropout": 0.1})
    plain = save_tiny("llama", tmp_path / "plain")  # the same weights, no dropout
    for folder, name in ((dropout, "full"), (plain, "no-dropout")):
        job = start_job([], tmp_path / f"{name}.log", config=_job(tmp_path, folder, name))
        assert job.wait() == 0, job.output()[-3000:]
    killed = _job(tmp_path, dropout, "killed")
    kill_after_save_and_resume(tmp_path / "runs" / "killed", [], STEPS, config=killed, killed_env=HOLD)
    full = _trained(tmp_path, "full")
    compare_runs(_trained(tmp_path, "killed"), full, rel=0)  # the same bits
    # the dropout is live: without it the same weights train to other numbers from the first step
    no_dropout = [r["loss"] for r in _trained(tmp_path, "no-dropout").records]
    assert all(a != b for a, b in zip([r["loss"] for r in full.records], no_dropout, strict=True))
