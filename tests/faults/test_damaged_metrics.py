"""A damaged tail of metrics.jsonl (a line cut by a full disk, garbage bytes) never blocks a restart:
the resumed job drops the tail with a warning and writes a clean file; `d9d metrics` reads it too."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _quickstart import overrides, run_local

pytestmark = pytest.mark.slow


def _d9d_metrics(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "d9d.cli", "metrics", str(run_dir)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "tail",
    [b'{"step": 5, "loss": 2.3', b"\x00\xff\xfe garbage \x89PNG\n\x00\x00"],
    ids=["cut-line", "garbage-bytes"],
)
def test_resume_drops_a_damaged_metrics_tail(tmp_path, tail):
    first = run_local(overrides(tmp_path, "run", 4))
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("ab") as f:
        f.write(tail)
    summary = _d9d_metrics(tmp_path / "run")  # the CLI survives the damaged file as it is
    assert summary.returncode == 0 and "steps: 1..4" in summary.stdout, summary.stdout + summary.stderr
    resumed = run_local(overrides(tmp_path, "run", 6))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    out = resumed.stdout + resumed.stderr
    assert "resumed" in out and "damaged line" in out, out[-3000:]
    records = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    summary = _d9d_metrics(tmp_path / "run")
    assert summary.returncode == 0 and "unreadable" not in summary.stdout, summary.stdout + summary.stderr
