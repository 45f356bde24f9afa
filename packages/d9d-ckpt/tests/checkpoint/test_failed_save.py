"""A save that fails while writing leaves nothing behind; leftovers of crashed saves can be removed."""

import errno
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import filesystem

from d9d.ckpt import CheckpointError, CheckpointManager
from d9d.ckpt.checkpoint.layout import list_checkpoints, stale_dirs


def test_write_error_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, "run")
    manager.save(1, model)
    create_stream = filesystem.FileSystem.create_stream

    def full(self, path, mode):  # type: ignore[no-untyped-def]
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return create_stream(self, path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
    with torch.no_grad():
        model.weight.fill_(7.0)
    with pytest.raises(CheckpointError) as info:
        manager.save(2, model)
    message = str(info.value)
    assert "\n" not in message and "OSError: [Errno 28] No space left on device" in message, message
    assert "the previous checkpoint stays the latest" in message
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [1]
    assert stale_dirs(tmp_path / "run") == []  # the failed save's files are gone


def test_remove_leftovers(tmp_path):
    run = tmp_path / "run"
    (run / ".save-3.tmp-abc123").mkdir(parents=True)
    (run / ".trash-save-1-def456").mkdir()
    (run / "save-9").mkdir()  # uncommitted but not a leftover name: untouched
    manager = CheckpointManager(tmp_path, "run")
    assert sorted(p.name for p in manager.remove_leftovers()) == [
        ".save-3.tmp-abc123",
        ".trash-save-1-def456",
    ]
    assert sorted(p.name for p in run.iterdir()) == ["save-9"]
