"""A step whose loss is finite but whose gradient norm is not (inf, or nan) is handled like a non-finite
loss: `trainer.on_nonfinite: skip` leaves weights and optimizer state as they were and records the
step as skipped, on every rank when one rank's gradients alone went bad; `stop` (the default) ends
`python train.py` with exit status 2 and one `error:` line naming the step, its finite loss and its
grad norm, the last committed checkpoint staying the latest."""

import json
import math
import multiprocessing
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config, record_states

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def _config(save_dir: Path, task: str, on_nonfinite: str, mesh: dict | None = None) -> dict:
    config = job_config(str(save_dir), total_steps=4, mesh=mesh)
    config["providers"]["task"] = f"_job:{task}"
    config["trainer"]["on_nonfinite"] = on_nonfinite
    return config


def _train_recording(config: dict) -> tuple[bool, bool]:
    """Train; whether step 3 left this rank's weights and optimizer state as step 2 did, and whether
    step 4 changed them."""
    with Trainer.from_config(config) as trainer:
        after = record_states(trainer)
        trainer.train()
    assert len(after) == 4 and after[2].keys() == after[1].keys()
    kept = all(torch.equal(after[2][k], after[1][k]) for k in after[1])
    moved = not all(torch.equal(after[3][k], after[2][k]) for k in after[2])
    return kept, moved


def _assert_step_3_skipped(run_dir: Path) -> None:
    records = _records(run_dir)
    assert [r["skipped"] for r in records] == [False, False, True, False]
    assert math.isfinite(records[2]["loss"]) and not math.isfinite(records[2]["grad_norm"]), records[2]
    assert all(math.isfinite(r["grad_norm"]) for r in records if not r["skipped"])


@pytest.mark.parametrize("task", ["InfGradAtStepTask", "NaNGradAtStepTask"])
def test_a_finite_loss_with_a_nonfinite_grad_norm_skips_the_step(tmp_path, task):
    kept, moved = _train_recording(_config(tmp_path, task, "skip"))
    assert kept, "the skipped step moved the weights or the optimizer state"
    assert moved  # step 4 updated them
    _assert_step_3_skipped(tmp_path / "tiny")


def test_one_ranks_nonfinite_gradients_skip_the_step_on_every_rank_2ranks(tmp_path):
    config = _config(tmp_path, "InfGradOnRank1Task", "skip", mesh={"data_parallel_shard": 2})
    results = run_distributed(_train_recording, 2, config, timeout=120)
    assert results == [(True, True), (True, True)]  # both ranks kept step 2's shards, both moved on at 4
    _assert_step_3_skipped(tmp_path / "tiny")


def _main(config: str, stderr: str) -> None:
    from d9d.trainer import main

    # one thread (the trainer sets it from OMP_NUM_THREADS): the OpenMP pool this process inherited
    # from its parent (which trained in the tests before) has no threads after the fork, and a
    # parallel region of several waits on them forever
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115  # the fd, not pytest's capture
    code = 0
    try:
        main([config])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.stderr.flush()
        os._exit(code)


def test_a_finite_loss_with_a_nonfinite_grad_norm_stops_the_run_with_exit_2(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, "InfGradAtStepTask", "stop")), encoding="utf-8")
    stderr = tmp_path / "stderr.txt"
    process = multiprocessing.get_context("fork").Process(target=_main, args=(str(path), str(stderr)))
    process.start()
    process.join(120)
    if process.is_alive():
        process.kill()
        raise AssertionError("python train.py did not finish within 120 s")
    errors = [line for line in stderr.read_text().splitlines() if line.startswith("error: ")]
    assert process.exitcode == 2, stderr.read_text()[-2000:]
    (line,) = errors
    found = re.match(r"error: step 3: loss (\S+) / grad norm (\S+) is not finite; stopping\. ", line)
    assert found is not None, line
    assert math.isfinite(float(found[1])) and not math.isfinite(float(found[2])), line
    run = tmp_path / "tiny"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("save")) == ["save-2"]
    assert [r["step"] for r in _records(run)] == [1, 2]
