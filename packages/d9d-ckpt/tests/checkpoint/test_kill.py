"""SIGKILL in the middle of a save: the previous checkpoint stays the latest and loads exactly."""

import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from d9d.ckpt import CheckpointManager
from d9d.ckpt.checkpoint._testhooks import PAUSE_BEFORE_COMMIT_ENV, PAUSE_IN_PRUNE_ENV
from d9d.ckpt.checkpoint.layout import list_checkpoints, stale_dirs

_TEMP_DIR = re.compile(r"\.save-(\d+)\.tmp-[0-9a-f]+")
_SIZE = 1536  # one 9 MB weight + AdamW state: each save writes ~28 MB, long enough to be caught mid-way


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(_SIZE, _SIZE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.ones(1, _SIZE)).sum().backward()
    opt.step()
    return model, opt


def _save_forever(
    save_dir: Path, async_save: bool, pause_before_commit: bool, pause_in_prune: bool = False
) -> None:
    torch.set_num_threads(1)
    if pause_in_prune:  # the first prune (after step 3) holds with save-1 renamed aside
        os.environ[PAUSE_IN_PRUNE_ENV] = "60"
    model, opt = _model()
    manager = CheckpointManager(save_dir, "run", num_to_keep=2, async_save=async_save)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for tensor in [*model.parameters(), *opt.state[model.weight].values()]:
                tensor.fill_(step)
        manager.save(step, model, opt, extra_state={"step": step})
        if pause_before_commit and step == 1:
            manager.wait()  # step 1 commits; every later save stops just before its commit
            os.environ[PAUSE_BEFORE_COMMIT_ENV] = "60"


def _saves_in_progress(run_dir: Path, holding: str = "") -> list[int]:
    """Steps of the uncommitted save directories in `run_dir` that hold a file ending in `holding`."""
    return [
        int(m.group(1))
        for p in stale_dirs(run_dir)
        if (m := _TEMP_DIR.fullmatch(p.name)) and any(f.name.endswith(holding) for f in p.iterdir())
    ]


def _kill_mid_save(save_dir: Path, async_save: bool, phase: str) -> int:
    """Start a process that saves in a loop and SIGKILL it in the middle of a save.

    phase "writing": as soon as a shard file of a save appears (the shards are being written);
    "written": once every shard and the metadata are written, before the commit (held there by the
    pause hook). Returns the step of the save that was interrupted.
    """
    run_dir = save_dir / "run"
    holding = ".distcp" if phase == "writing" else ".metadata"
    proc = multiprocessing.get_context("fork").Process(
        target=_save_forever, args=(save_dir, async_save, phase == "written"), daemon=True
    )
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if list_checkpoints(run_dir) and (steps := _saves_in_progress(run_dir, holding)):
                os.kill(proc.pid, signal.SIGKILL)
                return max(steps)
            time.sleep(0.0005)
        raise AssertionError("no save was seen in progress within 30 s")
    finally:
        proc.kill()
        proc.join(5)


@pytest.mark.parametrize("phase", ["writing", "written"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path, async_save, phase):
    for attempt in range(3):  # the kill must land while the save is unfinished; retry if it was late
        save_dir = tmp_path / f"attempt{attempt}"
        interrupted = _kill_mid_save(save_dir, async_save, phase)
        manager = CheckpointManager(save_dir, "run")
        if interrupted in _saves_in_progress(manager.run_dir):
            break
    else:
        pytest.fail("the kill never landed inside a save")

    latest = manager.latest()
    assert latest is not None and latest.step == interrupted - 1
    for info in manager.checkpoints():  # every committed checkpoint is whole and exact
        model, opt = _model()
        loaded = manager.load(info, model, opt)
        assert loaded.extra_state == {"step": info.step}
        assert torch.all(model.weight == info.step) and torch.all(model.bias == info.step)
        assert all(torch.all(t == info.step) for t in opt.state[model.weight].values())

    # The restarted job saves again: its commit removes what the killed one left behind.
    model, opt = _model()
    manager.save(interrupted, model, opt, extra_state={"step": interrupted})
    manager.wait()  # the cleanup after a commit runs in the background
    assert stale_dirs(manager.run_dir) == []
    assert [i.step for i in manager.checkpoints()][-1] == interrupted


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_mid_prune_leaves_the_kept_checkpoints_loadable(tmp_path, async_save):
    run_dir = tmp_path / "run"
    proc = multiprocessing.get_context("fork").Process(
        target=_save_forever, args=(tmp_path, async_save, False, True), daemon=True
    )
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not (run_dir.is_dir() and any(run_dir.glob(".trash-save-*"))):
            assert time.monotonic() < deadline, "no prune was seen within 30 s"
            time.sleep(0.0005)
        os.kill(proc.pid, signal.SIGKILL)  # the prune thread holds save-1 renamed aside, not deleted
    finally:
        proc.kill()
        proc.join(5)

    manager = CheckpointManager(tmp_path, "run", num_to_keep=2)
    assert [p.name[:14] for p in stale_dirs(run_dir)] == [".trash-save-1-"]
    assert [i.step for i in manager.checkpoints()] == [2, 3]
    for info in manager.checkpoints():
        model, opt = _model()
        assert manager.load(info, model, opt).extra_state == {"step": info.step}
        assert torch.all(model.weight == info.step)
    model, opt = _model()
    manager.save(4, model, opt, extra_state={"step": 4})
    manager.close()
    assert stale_dirs(run_dir) == [] and [i.step for i in list_checkpoints(run_dir)] == [3, 4]
