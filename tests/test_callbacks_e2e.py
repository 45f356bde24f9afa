"""Callbacks (`d9d.trainer.Callback`) through the trainer, in real processes.

One process: the events come in order with the run's own numbers (each `on_step` record is the
metrics.jsonl line, `on_eval` the eval the record holds, `on_checkpoint` a committed directory), a
callback from the config and one passed in Python see the same. The docs' `LossTarget`, run as
docs/extending.md prints it: its stop ends the run, finished, at the step the page says (one after
the flush that brought the record), exit 0, and the same command again says the run already stopped
and trains nothing. FSDP 2: a stop and a save asked on rank 0 alone take effect on both ranks at the
same step (agreed in the step's one sync), both end the run as finished, and the run resumed without
the callback ends with the uninterrupted run's losses, grad norms and weights. A callback that raises
on rank 1 stops both ranks with its error. Bad `trainer.callbacks` entries are cases of
tests/bad_input/cases.yaml.
"""

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, TINY, overrides, records, run_forked, train
from test_evaluation import EVAL

from d9d.ckpt import list_checkpoints
from d9d.ckpt.checkpoint.extra import decode_state
from d9d.ckpt.checkpoint.layout import EXTRA_FILE
from d9d.mesh.testing import DistributedTestError, run_distributed

#: A callback that writes every event to <run_dir>/events-<rank>.jsonl and does what its config asks
#: on the ranks it names: save after a step, stop after a step, raise at a step.
RECORDER = textwrap.dedent("""
    import json
    from dataclasses import dataclass, field
    from pathlib import Path

    from d9d.trainer import Callback


    @dataclass
    class RecorderConfig:
        ranks: list = field(default_factory=lambda: [0, 1])
        save_at: int = 0
        stop_at: int = 0
        raise_at: int = 0


    class Recorder(Callback):
        main_process_only = False
        config_type = RecorderConfig

        def _write(self, run, event, **fields):
            line = json.dumps({"event": event, "step": run.step, **fields})
            with Path(run.run_dir, f"events-{run.rank}.jsonl").open("a") as file:
                file.write(line + "\\n")

        def on_job_built(self, run):
            self._write(run, "job_built", world=run.plan.mesh.world_size)

        def on_step(self, run, record):
            self._write(run, "step", record=dict(record))
            if run.rank in self.config.ranks:
                if record["step"] == self.config.save_at:
                    run.request_save()
                if record["step"] == self.config.stop_at:
                    run.request_stop(f"recorder at step {record['step']}")
                if record["step"] == self.config.raise_at:
                    raise RuntimeError(f"recorder raised at step {record['step']}")

        def on_eval(self, run, result):
            self._write(run, "eval", loss=result.loss, at=result.step)

        def on_checkpoint(self, run, step, path):
            self._write(run, "checkpoint", at=step, path=str(path), committed=Path(path, "commit.json").is_file())

        def on_train_end(self, run, result):
            self._write(run, "train_end", final_step=result.final_step, stopped_by=result.stopped_by,
                        preempted=result.preempted)

        def on_failure(self, run, error):
            self._write(run, "failure", error=str(error))
""")


def _recorder(tmp_path: Path, **config: Any) -> str:
    """The override registering the recorder (written next to nothing else: paths resolve from CONFIG's
    directory, so it is given by absolute path) with `config`."""
    path = tmp_path / "recorder.py"
    path.write_text(RECORDER)
    return f"trainer.callbacks=[{{target: '{path}:Recorder', config: {json.dumps(config)}}}]"


def _events(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / f"events-{rank}.jsonl").read_text().splitlines()]


class _InPython:
    """A callback passed to Trainer in Python: the events it saw, by name."""

    def __init__(self) -> None:
        from d9d.trainer import Callback

        class Collect(Callback):
            def __init__(self) -> None:
                super().__init__()
                self.seen: list[tuple[str, int]] = []

            def on_job_built(self, run: Any) -> None:
                self.seen.append(("job_built", run.step))

            def on_step(self, run: Any, record: Any) -> None:
                self.seen.append(("step", record["step"]))

            def on_eval(self, run: Any, result: Any) -> None:
                self.seen.append(("eval", result.step))

            def on_checkpoint(self, run: Any, step: int, path: Path) -> None:
                self.seen.append(("checkpoint", step))

            def on_train_end(self, run: Any, result: Any) -> None:
                self.seen.append(("train_end", result.final_step))

        self.callback = Collect()


def _train_with_python_callback(args: list[str]) -> list[tuple[str, int]]:
    from d9d.trainer import Trainer

    collect = _InPython().callback
    with Trainer.from_config(CONFIG, args, callbacks=[collect]) as trainer:
        trainer.train()
    return collect.seen


def test_events_come_in_order_with_the_runs_own_numbers_from_the_config_and_from_python(tmp_path):
    args = overrides(tmp_path, "one", 4, *EVAL, _recorder(tmp_path))
    in_python = run_forked(_train_with_python_callback, args)
    run_dir = tmp_path / "one"
    events = _events(run_dir)
    assert [(e["event"], e.get("at", e["step"])) for e in events] == [
        ("job_built", 0),
        ("step", 1),
        ("step", 2),
        ("eval", 2),
        ("checkpoint", 2),
        ("step", 3),
        ("step", 4),
        ("eval", 4),
        ("checkpoint", 4),
        ("train_end", 4),
    ]
    assert [name for name, _ in in_python] == [e["event"] for e in events]  # config first, then Python's
    written = records(run_dir)
    assert [e["record"] for e in events if e["event"] == "step"] == written  # the metrics.jsonl lines
    evals = {e["at"]: e["loss"] for e in events if e["event"] == "eval"}
    assert evals == {r["step"]: r["eval_loss"] for r in written if "eval_loss" in r}
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert [Path(e["path"]).name for e in saved] == ["save-2", "save-4"] and all(
        e["committed"] for e in saved
    )
    assert events[-1]["stopped_by"] is None


#: docs/extending.md's command, with the tiny quickstart model and records every 4 steps (the page's
#: config writes them every 10): the callback sees step k's record at the first flush at or after k.
_LOSS_TARGET = "trainer.callbacks=[{target: callbacks.py:LossTarget, config: {loss: 4.0}}]"
_PERIOD = 4
_TINY_SETS = [*(a for a in TINY if not a.startswith(("trainer.logging.period_steps", "trainer.checkpointing"))),
              f"trainer.logging.period_steps={_PERIOD}", "trainer.checkpointing.period_steps=0",
              "trainer.schedule.total_steps=40", "trainer.logging.progress_bar=false"]  # fmt: skip


def _d9d_train(cwd: Path, sets: list[str]) -> tuple[int, str]:
    """`d9d train config.yaml --set ...` in `cwd` (forked from this process): its exit status and output."""
    from click.testing import CliRunner

    from d9d.cli import cli

    os.chdir(cwd)
    result = CliRunner().invoke(cli, ["train", "config.yaml", *(a for s in sets for a in ("--set", s))])
    return result.exit_code, result.output


def test_the_docs_loss_target_ends_the_run_finished_and_the_same_command_says_it_already_stopped(tmp_path):
    for folder in ("quickstart", "data"):
        shutil.copytree(Path(CONFIG).parents[1] / folder, tmp_path / "examples" / folder)
    cwd, sets = tmp_path / "examples" / "quickstart", ["trainer.run.name=extended", _LOSS_TARGET, *_TINY_SETS]
    code, output = run_forked(_d9d_train, cwd, sets)
    assert code == 0, output[-3000:]  # a finish, not a pre-emption (75)
    run_dir = cwd / "runs" / "extended"
    losses = {r["step"]: r["loss"] for r in records(run_dir)}
    met = min(step for step, loss in losses.items() if loss < 4.0)
    seen = min(s for s in losses if s >= met and (s == 1 or s % _PERIOD == 0))  # the flush that brings it
    end = max(losses)
    assert end == seen + 1 and end < 40, (met, seen, end)  # read in the next step's sync, which runs
    assert [info.step for info in list_checkpoints(run_dir)] == [end]  # that step saved
    reason = f"loss {losses[met]:.3f} below 4.0 at step {met}"
    extra = decode_state((run_dir / f"save-{end}" / EXTRA_FILE).read_bytes(), "extra")
    assert extra["callback_stop"] == {"callback": "LossTarget", "reason": reason, "step": end}
    assert f"stopped at step {end} by callback LossTarget ({reason}); checkpoint saved" in output
    assert json.loads((run_dir / "loss-target.json").read_text())["stopped_by"] == reason

    metrics = (run_dir / "metrics.jsonl").read_text()
    code, again = run_forked(_d9d_train, cwd, sets)  # a scheduler's requeue: the same command
    assert code == 0, again[-3000:]
    assert f"run already stopped at step {end} by callback LossTarget ({reason})" in again
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no step trained
    assert [info.step for info in list_checkpoints(run_dir)] == [end]


def _final(run_dir: Path, weights: dict[str, torch.Tensor]) -> tuple[list[float], list[float]]:
    written = records(run_dir)
    return [r["loss"] for r in written], [r["grad_norm"] for r in written]


def test_rank_0_alone_stops_and_saves_both_ranks_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    fsdp = ["mesh.data_parallel_shard=2", "trainer.checkpointing.period_steps=0"]
    whole = train(2, overrides(tmp_path, "whole", 6, *fsdp))
    asked = _recorder(tmp_path, ranks=[0], save_at=1, stop_at=3)
    train(2, overrides(tmp_path, "cut", 6, *fsdp, asked))
    run_dir = tmp_path / "cut"
    for rank in (0, 1):  # both ranks saved after step 2 and stopped after step 4, saving it
        events = _events(run_dir, rank)
        assert [e["at"] for e in events if e["event"] == "checkpoint"] == [2, 4], (rank, events)
        assert [e["record"]["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]
        end = events[-1]
        assert end["event"] == "train_end" and end["final_step"] == 4 and end["preempted"] is False
        assert end["stopped_by"] == ("recorder at step 3" if rank == 0 else "a callback on another rank")
    assert sorted(p.name for p in run_dir.glob("save-*")) == ["save-2", "save-4"]
    resumed = train(2, overrides(tmp_path, "cut", 6, *fsdp))  # the same command, without the callback
    assert [r["step"] for r in resumed.records] == [1, 2, 3, 4, 5, 6]
    assert _final(run_dir, resumed.weights) == _final(tmp_path / "whole", whole.weights)  # bit for bit
    assert resumed.weights.keys() == whole.weights.keys()
    for name, value in whole.weights.items():
        assert torch.equal(resumed.weights[name], value), name


def _train_quickstart(args: list[str]) -> None:
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()


def test_a_callback_that_raises_on_rank_1_stops_both_ranks_with_its_error(tmp_path):
    args = overrides(
        tmp_path, "boom", 4, "mesh.data_parallel_shard=2", _recorder(tmp_path, ranks=[1], raise_at=2)
    )
    # both ranks fail, as on any job failure: rank 1 with its error, rank 0 with rank 1's (or, when the
    # failure board stops it first, exit status 2 after printing it)
    with pytest.raises(DistributedTestError, match=r"rank 1 failed in step 3: RuntimeError: recorder raised at "
                       r"step 2|exit code 2"):  # fmt: skip
        run_distributed(_train_quickstart, 2, args, timeout=120)
    for rank in (0, 1):  # rank 0 may be ended by the failure board before its loop hears of it
        events = _events(tmp_path / "boom", rank)
        assert [e["event"] for e in events][-1] == "failure" or rank == 0, (rank, events)
        assert not any(e["event"] == "train_end" for e in events)
        assert [e["record"]["step"] for e in events if e["event"] == "step"] == [1, 2]
    (failure,) = [e for e in _events(tmp_path / "boom", 1) if e["event"] == "failure"]
    assert failure["error"] == "recorder raised at step 2"
    assert not list((tmp_path / "boom").glob("save-*"))  # rank 1 raised before step 2's save: none committed


def test_the_extending_page_shows_the_example_callback_as_it_is():
    """docs/extending.md's Python block is examples/quickstart/callbacks.py's code (its docstrings aside),
    which the page's commands run."""
    root = Path(__file__).parents[1]
    page = (root / "docs" / "extending.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    source = iter((root / "examples" / "quickstart" / "callbacks.py").read_text().splitlines())
    for line in filter(str.strip, block.splitlines()):  # each shown line, in the file's order
        assert any(candidate == line for candidate in source), line
