"""Real torchrun launches: the launch check, a 2-node rendezvous on loopback, logs on every rank."""

import json
import re
import sys
from pathlib import Path

import pytest

from d9d.mesh import MeshConfig, rank_tag
from d9d.mesh.testing import run_torchrun

JOB = str(Path(__file__).with_name("_torchrun_job.py"))
LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) +\[(?P<tag>[^\]]+)\] +(?P<logger>[\w.]+): (?P<rest>.*)$"
)

pytestmark = pytest.mark.slow


def test_world_size_mismatch_through_torchrun(tmp_path):
    mesh = {"data_parallel_shard": 2, "tensor_parallel": 2}
    result = run_torchrun([JOB, json.dumps(mesh), str(tmp_path / "logs")], nproc_per_node=2, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    # each rank that gets to print says the same one line (torchrun may stop a peer before it prints)
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1
    assert "needs 4 processes, but torchrun started 2" in errors[0]
    assert "--nproc-per-node 4" in errors[0]
    assert not (tmp_path / "logs").exists()  # nothing written before the check


def test_two_node_loopback_launch_logs_on_every_rank(tmp_path):
    config = MeshConfig(data_parallel_replicate=2, data_parallel_shard=2)
    mesh = {"data_parallel_replicate": 2, "data_parallel_shard": 2}
    result = run_torchrun(
        [JOB, json.dumps(mesh), str(tmp_path / "logs")], nproc_per_node=2, nnodes=2, timeout=180
    )
    assert result.returncode == 0, result.output[-3000:]
    lines = [m for m in map(LINE.match, result.stdout.splitlines()) if m]
    reduced = [m for m in lines if m["rest"].startswith("reduced")]
    assert sorted(m["tag"].strip() for m in reduced) == [rank_tag(config, r) for r in range(4)]
    assert all("total=6" in m["rest"] for m in reduced)  # 0+1+2+3 over both "nodes"
    stdlib = [m for m in lines if m["logger"] == "torch.fake"]
    assert len(stdlib) == 4 and all(m["level"] == "WARNING" for m in stdlib)
    # per-rank files hold that rank's lines only
    for rank in range(4):
        text = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        tags = {m["tag"].strip() for m in map(LINE.match, text.splitlines()) if m}
        assert tags == {rank_tag(config, rank)}


def test_json_logs_under_torchrun(tmp_path):
    result = run_torchrun(
        [JOB, json.dumps({"data_parallel_shard": 2}), str(tmp_path / "logs"), "json"],
        nproc_per_node=2,
        timeout=120,
    )
    assert result.returncode == 0, result.output[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    reduced = sorted((r for r in records if r["event"] == "reduced"), key=lambda r: r["rank"])
    assert [r["rank"] for r in reduced] == [0, 1]
    assert [r["coords"] for r in reduced] == [{"dp_shard": 0}, {"dp_shard": 1}]
    assert all(r["level"] == "info" and r["logger"] == "job" and r["total"] == 1.0 for r in reduced)


def test_local_job_runs_without_torchrun(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, JOB, "{}"], capture_output=True, text=True, timeout=120, check=True)
    assert re.search(r"\[local\] +job: reduced +total=0", out.stdout), out.stdout
