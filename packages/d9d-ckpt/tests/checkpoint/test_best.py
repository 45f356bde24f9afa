"""Best checkpoints (`KeepBest`): ranked from the metrics commit records hold, kept next to the newest."""

import math
from pathlib import Path

import pytest
from _ckpt_testlib import adamw, tiny_model, train_step

from d9d.ckpt import CheckpointManager, KeepBest, best_checkpoints, list_checkpoints, metric_of
from d9d.ckpt.checkpoint import retention
from d9d.ckpt.checkpoint.layout import CheckpointInfo, CheckpointMeta


def _info(step: int, loss: float | None) -> CheckpointInfo:
    meta = CheckpointMeta(
        step=step, created_at="", d9d_ckpt_version="", torch_version="", world_size=1, mesh=None,
        has_optimizer=False, files={}, metrics=None if loss is None else {"eval_loss": loss},
    )  # fmt: skip
    return CheckpointInfo(step=step, path=Path(f"save-{step}"), meta=meta)


LOSSES = {1: 3.0, 2: 1.0, 3: None, 4: 2.0, 5: 1.0, 6: math.nan, 7: 5.0}


@pytest.mark.parametrize(
    ("mode", "count", "best"),
    [("min", 1, [2]), ("min", 2, [2, 5]), ("min", 9, [2, 5, 4, 1, 7]), ("max", 2, [7, 1])],
)
def test_best_ranks_recorded_values_and_never_a_checkpoint_without_one(mode, count, best):
    committed = [_info(s, loss) for s, loss in LOSSES.items()]
    assert [i.step for i in best_checkpoints(committed, KeepBest("eval_loss", mode, count))] == best
    assert best_checkpoints(committed, KeepBest("eval_perplexity")) == []  # no record holds it


@pytest.mark.parametrize(
    ("keep", "num_to_keep", "count", "deleted"),
    [
        (7, 2, 1, [1, 3, 4, 5]),  # newest 6, 7 and the best (2)
        (7, 1, 2, [1, 3, 4, 6]),  # newest 7 and the two best (2, 5)
        (4, 1, 1, [1, 3, 5, 6, 7]),  # an older step saved again: kept, with the best
        (7, None, 1, []),
    ],
)
def test_retention_keeps_the_newest_and_the_best(keep, num_to_keep, count, deleted):
    committed = [_info(s, loss) for s, loss in LOSSES.items()]
    policy = KeepBest("eval_loss", "min", count)
    found = retention.excess_checkpoints(committed, Path(f"save-{keep}"), num_to_keep, policy)
    assert [i.step for i in found] == deleted


@pytest.mark.parametrize(("mode", "count"), [("lowest", 1), ("min", 0)])
def test_a_bad_policy_is_refused(mode, count):
    with pytest.raises(ValueError, match="keep_best"):
        KeepBest("eval_loss", mode, count)


def test_saves_record_their_metric_and_the_best_survive_retention(tmp_path):
    model = tiny_model()
    opt = adamw(model)
    losses = {1: 2.0, 2: 0.5, 3: 1.5, 4: None, 5: 1.0, 6: 3.0}
    policy = KeepBest("eval_loss", "min", 2)
    with CheckpointManager(tmp_path, "run", num_to_keep=1, keep_best=policy) as manager:
        for step, loss in losses.items():
            train_step(model, opt, step)
            metrics = None if loss is None else {"eval_loss": loss}
            manager.save(step, model, opt, extra_state={"step": step}, metrics=metrics, metrics_step=step)
        kept = manager.checkpoints()
    # read back from the commit records alone, as a fresh process (or the CLI) would
    assert [i.step for i in list_checkpoints(tmp_path / "run")] == [i.step for i in kept] == [2, 5, 6]
    assert [metric_of(i, "eval_loss") for i in kept] == [0.5, 1.0, 3.0]
    assert [i.meta.metrics_step for i in kept] == [2, 5, 6]
    assert [i.step for i in best_checkpoints(kept, policy)] == [2, 5]
