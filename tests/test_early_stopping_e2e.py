"""Best checkpoints (`trainer.checkpointing.keep_best`) and early stopping (`eval.early_stopping`) through
the trainer with the quickstart, in real processes.

keep_best (1 process): every commit record holds the eval numbers of its step, equal to metrics.jsonl,
and retention leaves exactly the newest plus the best by them. Early stopping (FSDP 2): the run stops
and saves at the eval that ran out of patience; a run ended mid-patience and resumed
stops at the same step with the same weights, bit for bit, since the patience counter rides in the
checkpoint (without it the resumed run would count afresh and stop two evals later); launched again,
the run is finished and trains nothing.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import NO_CLIP, SGD, overrides, records, run_forked, train
from test_evaluation import EVAL

from d9d.ckpt import KeepBest, best_checkpoints, list_checkpoints
from d9d.ckpt.checkpoint.extra import decode_state
from d9d.ckpt.checkpoint.layout import EXTRA_FILE

EVERY_STEP = [*EVAL, "eval.period_steps=1", "eval.steps=1"]  # one eval microbatch: the numbers, cheaply


def _evals(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records(run_dir) if "eval_loss" in r}


def test_keep_best_keeps_the_newest_and_the_best_by_the_recorded_eval_loss(tmp_path):
    best = "trainer.checkpointing.keep_best={metric: eval_loss, mode: max, count: 2}"
    args = overrides(tmp_path, "best", 6, *SGD, *NO_CLIP, *EVERY_STEP, "trainer.checkpointing.period_steps=1",
                     "trainer.checkpointing.num_to_keep=1", best)  # fmt: skip
    train(1, args)
    run_dir = tmp_path / "best"
    evals = _evals(run_dir)
    assert sorted(evals) == [1, 2, 3, 4, 5, 6]
    # mode max: the highest losses, i.e. (SGD at lr 0.5) the earliest steps, plus the newest
    expected = sorted({6, *sorted(evals, key=lambda s: (-evals[s], s))[:2]})
    kept = list_checkpoints(run_dir)
    assert [i.step for i in kept] == expected and len(expected) == 3
    for info in kept:  # the commit record holds its step's eval, as metrics.jsonl has it
        assert info.meta.metrics_step == info.step
        assert info.meta.metrics is not None and info.meta.metrics["eval_loss"] == evals[info.step]
    assert [i.step for i in best_checkpoints(kept, KeepBest("eval_loss", "max", 2))] == expected[:2]


def _patience(run_dir: Path, step: int) -> dict:
    return decode_state((run_dir / f"save-{step}" / EXTRA_FILE).read_bytes(), "extra")["early_stopping"]


def test_early_stopping_resumed_mid_patience_stops_where_the_uninterrupted_run_stops(tmp_path):
    # min_delta far above any change of the loss: the first eval is the best, every later one counts
    # against the patience of 3, so the run stops at the eval of step 4 of 8
    stop = ["eval.early_stopping={patience: 3, min_delta: 100.0}"]
    fsdp = ["mesh.data_parallel_shard=2", "trainer.checkpointing.period_steps=0"]
    whole = train(2, overrides(tmp_path, "whole", 8, *SGD, *NO_CLIP, *EVERY_STEP, *stop, *fsdp))
    assert [r["step"] for r in whole.records] == [1, 2, 3, 4]
    assert [i.step for i in list_checkpoints(tmp_path / "whole")] == [4]
    assert _patience(tmp_path / "whole", 4)["evals_without_improvement"] == 3

    # interrupted after step 2, one eval into the patience (a launch of 2 steps: the constant LR schedule
    # does not depend on total_steps; a stop by a signal or callback would skip that step's eval)
    cut = overrides(tmp_path, "cut", 8, *SGD, *NO_CLIP, *EVERY_STEP, *stop, *fsdp)
    train(2, [*cut, "trainer.schedule.total_steps=2"])
    assert [i.step for i in list_checkpoints(tmp_path / "cut")] == [2]
    assert _patience(tmp_path / "cut", 2)["evals_without_improvement"] == 1
    resumed = train(2, cut)
    assert [r["step"] for r in resumed.records] == [1, 2, 3, 4]
    assert [i.step for i in list_checkpoints(tmp_path / "cut")] == [2, 4]
    assert resumed.weights.keys() == whole.weights.keys()
    for name, value in whole.weights.items():
        assert torch.equal(resumed.weights[name], value), name
    assert _evals(tmp_path / "cut") == _evals(tmp_path / "whole")

    again = run_forked(_final_step, [*cut, "mesh.data_parallel_shard=1"])  # finished: it trains nothing
    assert again == (4, 4, True)


def _final_step(args: list[str]) -> tuple[int, int, bool]:
    from _quickstart import CONFIG

    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        result = trainer.train()
    return result.start_step, result.final_step, result.early_stopped is not None
