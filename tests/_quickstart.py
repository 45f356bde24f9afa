"""Run the quickstart job (tiny overrides) as a plain process or under torchrun, and read its results."""

import json
import subprocess
import sys
from pathlib import Path

from d9d.mesh.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "examples" / "quickstart" / "train.py")
CONFIG = str(ROOT / "examples" / "quickstart" / "config.yaml")

TINY = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "dataset.seq_len=32",
    "trainer.logging.period_steps=1",
    "trainer.checkpointing.period_steps=2",
    "lr_scheduler.name=constant",
    "lr_scheduler.warmup_steps=2",
]
MOE = ["model.moe={num_experts: 4, top_k: 2, moe_intermediate_size: 64}"]


def overrides(save_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    """The tiny quickstart with its checkpoints under save_dir/name."""
    return [*TINY, f"trainer.checkpointing.save_dir={save_dir}", f"trainer.run.name={name}",
            f"trainer.schedule.total_steps={steps}", *extra]  # fmt: skip


def run_local(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python train.py config.yaml ARGS` with no torchrun."""
    return subprocess.run(
        [sys.executable, TRAIN, CONFIG, *args], capture_output=True, text=True, timeout=timeout,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def run_ranks(nproc: int, args: list[str], timeout: float = 300) -> str:
    """`torchrun --nproc-per-node N train.py config.yaml ARGS`; returns the output, failing on error."""
    result = run_torchrun([TRAIN, CONFIG, *args], nproc_per_node=nproc, timeout=timeout)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


def losses(save_dir: Path, name: str) -> list[float]:
    """Losses per step from the run's metrics file."""
    lines = (save_dir / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]
