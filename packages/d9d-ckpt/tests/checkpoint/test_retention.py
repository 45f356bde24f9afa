"""Retention runs off the training path: a save returns while old checkpoints are still being deleted."""

import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from _ckpt_testlib import adamw, run_forked, sharded_job, tiny_model, train_step

from d9d.ckpt import CheckpointManager
from d9d.ckpt.checkpoint import retention
from d9d.ckpt.checkpoint.layout import CheckpointInfo, CheckpointMeta, list_checkpoints, stale_dirs
from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed


def _info(step: int) -> CheckpointInfo:
    meta = CheckpointMeta(
        step=step, created_at="", d9d_ckpt_version="", torch_version="", world_size=1, mesh=None,
        has_optimizer=False, files={},
    )  # fmt: skip
    return CheckpointInfo(step=step, path=Path(f"save-{step}"), meta=meta)


@pytest.mark.parametrize(
    ("steps", "keep", "num_to_keep", "deleted"),
    [
        ([1, 2, 3], 3, 2, [1]),
        ([1, 2, 3], 3, 1, [1, 2]),
        ([1, 2], 2, 3, []),
        ([1, 2, 3], 3, None, []),
        ([30, 35, 40], 35, 2, [30]),  # an older step saved again is kept, the newest too
        ([30, 35, 40], 35, 1, [30, 40]),
    ],
)
def test_excess_checkpoints(steps, keep, num_to_keep, deleted):
    found = retention.excess_checkpoints([_info(s) for s in steps], Path(f"save-{keep}"), num_to_keep)
    assert [i.step for i in found] == deleted


class _HeldPrune:
    """Replaces the crash-test pause inside pruning: holds the prune until released, and says where it ran."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()
        self.on_main_thread: bool | None = None

    def __call__(self, env: str, step: int) -> None:
        self.on_main_thread = threading.current_thread() is threading.main_thread()
        self.reached.set()
        if not self.on_main_thread:  # held inline, it would block the save forever: fail instead
            assert self.release.wait(30), "the test never released the prune"


def _save_while_pruning(save_dir: str, distributed: bool) -> dict:
    held = _HeldPrune()
    retention.pause_for_test = held  # (in a forked process: nothing to restore)
    if distributed:
        ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=2))
    else:
        ctx, model, opt = None, tiny_model(), None
        opt = adamw(model)
    manager = CheckpointManager(save_dir, "run", num_to_keep=1, context=ctx)
    rank = ctx.rank if ctx is not None else 0
    manager.save(1, model, opt)
    train_step(model, opt, 1)
    manager.save(2, model, opt)  # returns while save-1 is being deleted (held on rank 0)
    result: dict = {}
    if rank == 0:
        assert held.reached.wait(30), "pruning never started"
        run_dir = manager.run_dir
        result["during"] = (
            [i.step for i in list_checkpoints(run_dir)],
            [p.name for p in stale_dirs(run_dir)],
        )
        result["on_main_thread"] = held.on_main_thread
    if distributed:  # every rank got here while rank 0's prune is still held
        dist.barrier()
    held.release.set()
    manager.wait()
    if rank == 0:
        result["after"] = ([i.step for i in manager.checkpoints()], stale_dirs(manager.run_dir))
    manager.close()
    return result


def _check(result: dict) -> None:
    assert result["on_main_thread"] is False
    committed, trash = result["during"]
    assert committed == [2]  # save-1 is renamed aside (no longer a checkpoint), not yet deleted
    assert len(trash) == 1 and trash[0].startswith(".trash-save-1-")
    assert result["after"] == ([2], [])


def test_save_returns_while_the_old_checkpoint_is_deleted(tmp_path):
    _check(run_forked(_save_while_pruning, str(tmp_path), False))


def test_no_rank_waits_for_pruning_world2(tmp_path):
    results = run_distributed(_save_while_pruning, 2, str(tmp_path), True)
    _check(results[0])
