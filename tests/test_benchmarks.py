"""Benchmarks that must not rot: their small CPU modes run here (their figures are not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_throughput_tiny_mode_runs_every_cpu_phase(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for phase in ("fp32", "bf16", "bf16+full-ac", "plain-bf16"):
        assert any(line.startswith(phase + " ") for line in done.stdout.splitlines()), (phase, done.stdout)
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ["gpu step: d9d bf16 / plain bf16 loop"]
    assert rows[0]["ratio"] > 0
