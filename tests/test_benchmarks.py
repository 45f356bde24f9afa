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


def test_context_parallel_small_mode_counts_every_part_at_cp_1_2_4(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--seq", "64", "--cp", "1", "2", "4",
         "--repeats", "1", "--warmup", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    table = [cells for cells in map(str.split, done.stdout.splitlines()) if cells and cells[0].isdigit()]
    assert [(cells[0], cells[1]) for cells in table] == [("64", "1"), ("64", "2"), ("64", "4")], done.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and all(r["ratio"] > 0 for r in rows), rows
