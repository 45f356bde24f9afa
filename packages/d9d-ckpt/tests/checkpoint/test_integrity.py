"""Checksums: recorded per file at commit, verified before a load (`verify_on_load`) and on demand."""

import errno
import json
import os
import zlib

import pytest
from _ckpt_testlib import adamw, tiny_model, train_step
from structlog.testing import capture_logs
from torch import nn

from d9d.ckpt import (
    CheckpointDamagedError,
    CheckpointDiskFullError,
    CheckpointManager,
    FileProblem,
    check_checkpoint_files,
    read_checkpoint_info,
    verify_checkpoint,
)
from d9d.ckpt.checkpoint import commit as commit_module
from d9d.ckpt.checkpoint import storage
from d9d.ckpt.checkpoint.layout import COMMIT_FILE, list_checkpoints, stale_dirs


def _trained(steps: int = 2):
    model = tiny_model()
    opt = adamw(model)
    for s in range(steps):
        train_step(model, opt, s)
    return model, opt


def _flip_byte(path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    where = len(data) // 2 if offset is None else offset
    data[where] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path):
    """save-2 and save-4 of a tiny model with AdamW, rank state and extra state."""
    model, opt = _trained()
    with CheckpointManager(tmp_path, "run") as manager:
        for step in (2, 4):
            manager.save(step, model, opt, extra_state={"step": step}, rank_state={"r": 0})
    return tmp_path


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_commit_records_the_crc32_of_every_file(tmp_path, async_save):
    model, opt = _trained()
    with CheckpointManager(tmp_path, "run", async_save=async_save) as manager:
        manager.save(2, model, opt, extra_state={"step": 2}, rank_state={"r": 0})
        info = manager.wait() if async_save else manager.latest()
    assert info is not None
    meta = info.meta
    assert meta.checksums is not None and set(meta.checksums) == set(meta.files)
    assert {".metadata", "extra.msgpack", "rank-00000.msgpack", "__0_0.distcp"} <= set(meta.files)
    for name, recorded in meta.checksums.items():
        assert recorded == f"crc32:{zlib.crc32((info.path / name).read_bytes()):08x}", name


def test_flipped_byte_is_found_while_loading_and_names_the_recovery(run):
    info = read_checkpoint_info(run / "run" / "save-4")
    _flip_byte(info.path / "__0_0.distcp")
    fresh = tiny_model(seed=3)
    with (
        CheckpointManager(run, "run") as manager,  # verify_on_load is the default
        pytest.raises(CheckpointDamagedError) as err,
    ):
        manager.load(None, fresh, adamw(fresh))
    first, *rest = str(err.value).splitlines()
    # the checksums are computed while the load reads the files: the model's state is then undefined
    assert first == (
        f"checkpoint {info.path} cannot be loaded (1 problem); the model's state is undefined "
        "(found while loading it): do not use it:"
    )
    assert rest == [
        "  - save-4/__0_0.distcp is damaged (checksum mismatch); move save-4 aside to resume from save-2"
    ]
    # The recovery works: with save-4 moved aside the run resumes from save-2.
    os.rename(info.path, run / "run" / "save-4.damaged")
    with CheckpointManager(run, "run", verify_on_load=True) as manager:
        assert manager.load(None, fresh, adamw(fresh)).step == 2


def test_without_verify_on_load_a_flipped_byte_is_not_read(run):
    _flip_byte(run / "run" / "save-4" / "extra.msgpack", offset=-1)  # inside the last value: still decodes
    with CheckpointManager(run, "run", verify_on_load=False) as manager:
        assert manager.load(None).step == 4
    with (
        CheckpointManager(run, "run") as manager,
        pytest.raises(CheckpointDamagedError, match=r"extra\.msgpack is damaged"),
    ):
        manager.load(None)  # by default it is, also for a load of the extra state alone


def test_damaged_files_of_the_first_checkpoint_say_start_afresh(run):
    (run / "run" / "save-2" / "rank-00000.msgpack").unlink()
    os.truncate(run / "run" / "save-2" / ".metadata", 10)
    with (
        CheckpointManager(run, "run", verify_on_load=True) as manager,
        pytest.raises(CheckpointDamagedError) as err,
    ):
        manager.load(read_checkpoint_info(run / "run" / "save-2"))
    lines = str(err.value).splitlines()
    assert lines[1].startswith("  - save-2/.metadata is truncated: 10 bytes, the commit recorded ")
    assert lines[2] == "  - save-2/rank-00000.msgpack is missing (the commit recorded 4 bytes)"
    assert lines[-1] == "  move save-2 aside to start the run afresh (it has no earlier committed checkpoint)"


def test_file_check_names_each_file_of_another_size_by_kind(run):
    path = run / "run" / "save-4"
    assert check_checkpoint_files(read_checkpoint_info(path)) == []
    recorded = read_checkpoint_info(path).meta.files
    (path / "rank-00000.msgpack").unlink()
    os.truncate(path / ".metadata", 10)
    with open(path / "extra.msgpack", "ab") as f:
        f.write(b"x")
    problems = check_checkpoint_files(read_checkpoint_info(path))
    assert problems == [
        FileProblem(".metadata", "truncated", recorded[".metadata"], 10),
        FileProblem("extra.msgpack", "changed", recorded["extra.msgpack"], recorded["extra.msgpack"] + 1),
        FileProblem("rank-00000.msgpack", "missing", recorded["rank-00000.msgpack"]),
    ]
    assert (
        problems[2].describe("save-4") == "save-4/rank-00000.msgpack is missing (the commit recorded 4 bytes)"
    )
    unreadable = FileProblem("x", "unreadable", 3, error="[Errno 13] Permission denied")
    assert unreadable.describe("save-4") == "save-4/x cannot be read: [Errno 13] Permission denied"


def test_checkpoint_without_checksums_loads_and_verification_says_so(run):
    commit = run / "run" / "save-4" / COMMIT_FILE
    record = json.loads(commit.read_text())
    del record["checksums"]  # as written before d9d recorded checksums
    commit.write_text(json.dumps(record))
    info = read_checkpoint_info(commit.parent)
    assert info.meta.checksums is None
    verification = verify_checkpoint(info)
    assert verification.ok and not verification.has_checksums
    model = tiny_model(seed=3)
    with CheckpointManager(run, "run", verify_on_load=True) as manager, capture_logs() as logs:
        assert manager.load(None, model, adamw(model)).step == 4
    assert any("no checksums" in entry["event"] for entry in logs), logs


def test_verify_checkpoint_reports_each_damaged_file(run):
    path = run / "run" / "save-4"
    assert verify_checkpoint(read_checkpoint_info(path)).ok
    _flip_byte(path / "__0_0.distcp")
    os.truncate(path / "extra.msgpack", 1)
    result = verify_checkpoint(read_checkpoint_info(path))
    assert not result.ok and result.has_checksums
    assert result.problems[0].startswith("save-4/extra.msgpack is truncated: 1 bytes, the commit recorded")
    assert result.problems[1:] == ["save-4/__0_0.distcp is damaged (checksum mismatch)"]
    assert result.recovery == "move save-4 aside to resume from save-2"


def test_checksums_are_computed_by_reading_back_what_was_written(tmp_path, monkeypatch):
    read: list[str] = []
    original = storage.checksum_file

    def counting(path):  # type: ignore[no-untyped-def]
        read.append(path.name)
        return original(path)

    monkeypatch.setattr(storage, "checksum_file", counting)  # what the DCP writer reads back with
    with CheckpointManager(tmp_path, "run") as manager:
        manager.save(1, nn.Linear(3, 3), extra_state={"step": 1})
    # The shards and DCP's metadata are read back once each; msgpack files are summed from memory.
    assert sorted(read) == [".metadata", "__0_0.distcp"]


# ---------------------------------------------------------------- disk full, whichever layer


def _no_space(path) -> OSError:  # type: ignore[no-untyped-def]
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("layer", ["extra_state", "commit_record", "async_writer"])
def test_disk_full_in_any_layer_is_named_and_nothing_is_committed(tmp_path, monkeypatch, layer):
    model = nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, "run", async_save=layer == "async_writer")
    manager.save(2, model)
    manager.wait()
    write_durable = commit_module.write_durable

    def durable(path, data):  # type: ignore[no-untyped-def]
        name = {"extra_state": "extra.msgpack", "commit_record": COMMIT_FILE}.get(layer)
        if path.name == name and ".save-4." in str(path):
            raise _no_space(path)
        write_durable(path, data)

    monkeypatch.setattr(commit_module, "write_durable", durable)
    if layer == "async_writer":
        from torch.distributed.checkpoint import filesystem

        create_stream = filesystem.FileSystem.create_stream

        def full(self, path, mode):  # type: ignore[no-untyped-def]
            if "w" in mode and ".save-4." in str(path):
                raise _no_space(path)
            return create_stream(self, path, mode)

        monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
    with pytest.raises(CheckpointDiskFullError) as err:
        manager.save(4, model)
        manager.wait()
    manager.close()
    assert str(err.value).startswith(
        f"no space left on device while writing checkpoint step 4 to {tmp_path / 'run'}; the previous "
        "checkpoint stays the latest; free space or set trainer.checkpointing.save_dir ("
    ), str(err.value)
    assert "[Errno 28] No space left on device" in str(err.value)
    assert "\n" not in str(err.value)
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [2]
    assert stale_dirs(tmp_path / "run") == []
