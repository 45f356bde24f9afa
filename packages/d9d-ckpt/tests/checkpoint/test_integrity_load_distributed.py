"""Validation before a load runs on one rank: the other ranks touch only their own files (gloo ranks)."""

import builtins
import io
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _ckpt_testlib import one_error, sharded_job, train_step

from d9d.ckpt import CheckpointError, CheckpointManager
from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed


def _save(save_dir: str) -> None:
    ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=2))
    train_step(model, opt, 0)
    with CheckpointManager(save_dir, "run", context=ctx) as manager:
        manager.save(1, model, opt, extra_state={"step": 1}, rank_state={"rank": ctx.rank})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save_dir = tmp_path_factory.mktemp("validate")
    run_distributed(_save, 2, str(save_dir))
    return save_dir


class _FileCounter:
    """Counts `os.stat` and `open` calls on paths under `root` (by file name) while installed."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.stats: Counter[str] = Counter()
        self.opens: Counter[str] = Counter()
        self._stat, self._open, self._io_open = os.stat, builtins.open, io.open

    def _under(self, path: Any) -> str | None:
        try:
            text = os.fsdecode(path)
        except TypeError:
            return None  # a file descriptor
        return os.path.basename(text) or text if text.startswith(self.root) else None

    def __enter__(self) -> "_FileCounter":
        def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            if (name := self._under(path)) is not None:
                self.stats[name] += 1
            return self._stat(path, *args, **kwargs)

        def open_(path: Any, *args: Any, **kwargs: Any) -> Any:
            if (name := self._under(path)) is not None:
                self.opens[name] += 1
            return self._open(path, *args, **kwargs)

        os.stat, builtins.open, io.open = stat, open_, open_
        return self

    def __exit__(self, *exc: object) -> None:
        os.stat, builtins.open, io.open = self._stat, self._open, self._io_open


def _load_counting(save_dir: str, world_size: int, verify: bool = False) -> dict[str, Any]:
    ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=world_size), seed=3)
    with CheckpointManager(save_dir, "run", context=ctx, verify_on_load=verify) as manager:
        counter = _FileCounter(manager.run_dir)
        error = None
        with counter:
            try:
                loaded = manager.load(None, model, opt)
            except CheckpointError as exc:
                error = str(exc)
    return {
        "stats": dict(counter.stats),
        "opens": dict(counter.opens),
        "error": error,
        "rank_state": None if error else loaded.rank_state,
    }


@pytest.mark.parametrize("world_size", [2, 4], ids=["world2", "world4"])
def test_only_rank0_stats_the_files_of_a_checkpoint(saved, world_size):
    results = run_distributed(_load_counting, world_size, str(saved), world_size)
    assert all(r["error"] is None for r in results), results[0]["error"]
    files = {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.msgpack", "rank-00000.msgpack"}
    assert files <= set(results[0]["stats"])  # rank 0 checked every recorded file's size
    for rank, result in enumerate(results[1:], start=1):
        assert result["stats"] == {}, (rank, result["stats"])
        # Only what this rank loads: its shards (and its own rank file), never the shared files.
        assert not {".metadata", "extra.msgpack", "commit.json"} & set(result["opens"]), (rank, result)
        assert set(result["opens"]) <= {"__0_0.distcp", "__1_0.distcp", f"rank-{rank:05d}.msgpack"}
        assert any(name.endswith(".distcp") for name in result["opens"])  # the counter sees DCP reads
    # The shared metadata is read once for the whole load, by rank 0.
    assert results[0]["opens"].get(".metadata") == 1
    if world_size == 2:
        assert [r["rank_state"] for r in results] == [{"rank": 0}, {"rank": 1}]


def test_verification_while_loading_reads_each_file_on_one_rank(saved):
    # verify_on_load (the default): the file a rank loads, that rank checksums; the shared ones, rank 0
    results = run_distributed(_load_counting, 2, str(saved), 2, True)
    assert all(r["error"] is None for r in results), results[0]["error"]
    assert {".metadata", "extra.msgpack", "__0_0.distcp"} <= set(results[0]["opens"])
    assert not {".metadata", "extra.msgpack", "commit.json", "__0_0.distcp"} & set(results[1]["opens"])
    assert {"__1_0.distcp", "rank-00001.msgpack"} <= set(results[1]["opens"])
    assert results[1]["stats"] == {}


@pytest.mark.parametrize("world_size", [2, 4], ids=["world2", "world4"])
def test_damaged_checkpoint_fails_with_one_message_on_every_rank(saved, tmp_path, world_size):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / "run" / "save-1" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    results = run_distributed(_load_counting, world_size, str(tmp_path), world_size)
    message = one_error(results)
    assert message.startswith(
        f"checkpoint {tmp_path / 'run' / 'save-1'} cannot be loaded (1 problem); nothing was loaded:\n"
        "  - save-1/__1_0.distcp is truncated: "
    )
    assert ", the commit recorded " in message and "; it holds keys model." in message
    for rank, result in enumerate(results[1:], start=1):
        assert result["stats"] == {} and result["opens"] == {}, (rank, result)
