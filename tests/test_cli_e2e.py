"""End to end through the `d9d` command: init → train under torchrun → checkpoints → metrics → export.

Real processes only (torchrun for training, `python -m d9d.cli` for the rest), on CPU with gloo.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from d9d.mesh.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# The shipped quickstart, made small enough for a test (the config file itself is unchanged).
SMALL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "dataset.seq_len=32",
    "data.global_batch_size=8",
    "data.microbatch_size=2",
    "trainer.checkpointing.period_steps=2",
    "trainer.logging.period_steps=1",
    "trainer.logging.progress_bar=false",
]


def _sets(items):
    return [arg for item in items for arg in ("--set", item)]


def _d9d(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "d9d.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_quickstart_from_init_to_export(tmp_path):
    made = _d9d("init", "job", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    config = str(tmp_path / "job" / "config.yaml")
    work = tmp_path / "work"  # start the job from elsewhere: providers and corpus resolve next to the config
    work.mkdir()

    plan = _d9d("plan", config, "--world-size", "2", *_sets([*SMALL, "mesh.data_parallel_shard=2"]), cwd=work)
    assert plan.returncode == 0, plan.stderr
    assert "data: global batch 8 = 2 data-parallel ranks × 2 microbatches of 2 per step" in plan.stdout
    # the launch command names this environment's torchrun (runnable as printed, also under uv run)
    launch = next(line.strip() for line in plan.stdout.splitlines() if "--nproc-per-node" in line)
    program, rest = launch.split(" ", 1)
    assert program.endswith("torchrun") or program.endswith("python"), launch
    assert " --nproc-per-node 2 -m d9d.cli train " in f" {rest}", launch

    trained = run_torchrun(
        [
            "-m",
            "d9d.cli",
            "train",
            config,
            *_sets([*SMALL, "mesh.data_parallel_shard=2", "trainer.schedule.total_steps=4"]),
        ],
        nproc_per_node=2,
        cwd=work,
        timeout=240,
    )
    assert trained.returncode == 0, trained.output[-4000:]
    run_dir = tmp_path / "job" / "runs" / "quickstart"  # save_dir is relative to the config file

    listed = _d9d("checkpoints", str(run_dir), cwd=work)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["2", "4"]
    assert all("dp_shard=2" in row and row[-1] == "ok" for row in rows)

    summary = _d9d("metrics", str(run_dir), cwd=work)
    assert summary.returncode == 0, summary.stderr
    assert "steps: 1..4 (4 steps)" in summary.stdout and "restarts: 0" in summary.stdout

    # Exported on one process from the 2-rank checkpoint (resharded), from the run directory alone.
    exported = _d9d("export", str(run_dir), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    weights = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        weights.update(load_file(file))
    assert weights["model.embed_tokens.weight"].shape == (257, 32)  # Hugging Face's names: a Llama
    assert len([k for k in weights if k.startswith("model.layers.")]) == 2 * 9
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"

    # Raising total_steps continues the run in one process (another mesh): steps 5 and 6 are appended.
    more = _d9d("train", config, *_sets([*SMALL, "trainer.schedule.total_steps=6"]), cwd=work)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_torchrun_launch_that_does_not_match_the_mesh_is_one_line(tmp_path):
    made = _d9d("init", "job", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    result = run_torchrun(
        ["-m", "d9d.cli", "train", str(tmp_path / "job" / "config.yaml")],
        nproc_per_node=2,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]  # printed by rank 0 only
    assert "needs 1 process" in errors[0] and "torchrun started 2" in errors[0]
    assert not (tmp_path / "runs").exists()  # nothing written before the check


def test_plan_the_repository_quickstart_for_8_ranks():
    config = str(ROOT / "examples" / "quickstart" / "config.yaml")
    result = _d9d(
        "plan",
        config,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--set",
        "mesh.data_parallel_shard=8",
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "mesh: data_parallel_shard=8 → world size 8" in result.stdout
    assert "1/8 of the model" in result.stdout
    assert "--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in result.stdout
