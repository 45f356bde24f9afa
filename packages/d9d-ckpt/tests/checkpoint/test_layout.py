"""Naming and discovery of checkpoint directories, without processes or tensors."""

import msgspec
import pytest

from d9d.ckpt import CheckpointError, CheckpointMeta, RunEntryKind, classify_run_entry, read_checkpoint_info
from d9d.ckpt.checkpoint.layout import (
    COMMIT_FILE,
    list_checkpoints,
    parse_step_dir,
    stale_dirs,
    step_dir_name,
    temp_dir_name,
    trash_dir_name,
)


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        created_at="2026-01-01T00:00:00+00:00",
        d9d_ckpt_version="0",
        torch_version="0",
        world_size=1,
        mesh=None,
        has_optimizer=False,
        files={},
    )


def _committed(run_dir, step, marker_step=None):
    path = run_dir / step_dir_name(step)
    path.mkdir(parents=True)
    (path / COMMIT_FILE).write_bytes(msgspec.json.encode(_meta(step if marker_step is None else marker_step)))
    return path


def test_names_round_trip():
    for step in (0, 7, 123456):
        assert parse_step_dir(step_dir_name(step)) == step
        assert parse_step_dir(temp_dir_name(step, "ab12")) is None
        assert parse_step_dir(trash_dir_name(step, "ab12")) is None
    for name in ("save-", "save-x", "save-1.tmp", "latest", "save--1"):
        assert parse_step_dir(name) is None
    with pytest.raises(ValueError, match="step"):
        step_dir_name(-1)


def test_only_committed_directories_are_checkpoints_sorted_by_step(tmp_path):
    for step in (10, 2, 100):
        _committed(tmp_path, step)
    (tmp_path / step_dir_name(5)).mkdir()  # renamed but no marker: not committed
    _committed(tmp_path, 7, marker_step=8)  # marker of another step: refused
    (tmp_path / step_dir_name(9)).mkdir()
    (tmp_path / step_dir_name(9) / COMMIT_FILE).write_text("{not json")  # unreadable marker
    tmp = tmp_path / temp_dir_name(200, "deadbeef")
    tmp.mkdir()
    (tmp / COMMIT_FILE).write_bytes(msgspec.json.encode(_meta(200)))  # complete but never renamed
    (tmp_path / "notes.txt").write_text("hello")

    infos = list_checkpoints(tmp_path)

    assert [i.step for i in infos] == [2, 10, 100]
    assert [i.path.name for i in infos] == ["save-2", "save-10", "save-100"]
    assert infos[0].meta == _meta(2)


def test_run_entries_are_classified_by_the_names_this_package_gives():
    assert classify_run_entry(step_dir_name(12)) is RunEntryKind.CHECKPOINT
    assert classify_run_entry(temp_dir_name(12, "0a1b2c3d0001")) is RunEntryKind.UNFINISHED_SAVE
    assert classify_run_entry(trash_dir_name(12, "ff00aa11bb22")) is RunEntryKind.INTERRUPTED_DELETION
    for name in ("metrics.jsonl", "save-", "save-1.tmp", ".save-3.tmp-NOTHEX", ".save-3.tmp-zzz",
                 ".trash-save-1-", ".trash-save-x-ab", "save-4.damaged"):  # fmt: skip
        assert classify_run_entry(name) is RunEntryKind.OTHER, name


def test_stale_dirs_are_only_our_leftovers(tmp_path):
    tmp = tmp_path / temp_dir_name(3, "0a1b")
    trash = tmp_path / trash_dir_name(1, "ff00")
    for path in (tmp, trash, tmp_path / ".save-3.tmp-NOTHEX", tmp_path / "other"):
        path.mkdir()
    _committed(tmp_path, 4)
    assert stale_dirs(tmp_path) == sorted([tmp, trash])
    assert stale_dirs(tmp_path / "absent") == []
    assert list_checkpoints(tmp_path / "absent") == []


def test_read_checkpoint_info(tmp_path):
    path = _committed(tmp_path, 3)
    assert read_checkpoint_info(path).step == 3
    (tmp_path / "save-4").mkdir()
    with pytest.raises(CheckpointError, match="save-4 is not a committed checkpoint"):
        read_checkpoint_info(tmp_path / "save-4")
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        read_checkpoint_info(tmp_path)
