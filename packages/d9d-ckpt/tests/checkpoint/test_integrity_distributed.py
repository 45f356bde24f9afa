"""Commit-time and load-time integrity over real gloo ranks (worlds 2 and 4): shared save_dir, checksums
(also verified on fewer ranks than saved), full disk."""

import errno
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt_testlib import one_error, run_forked, sharded_job, train_step
from torch.distributed.checkpoint import FileSystemReader

from d9d.ckpt import (
    CheckpointDamagedError,
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointManager,
)
from d9d.ckpt.checkpoint.integrity import verifier_of
from d9d.ckpt.checkpoint.layout import list_checkpoints, stale_dirs
from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed

WORLD2 = MeshConfig(data_parallel_shard=2)
WORLD4 = MeshConfig(data_parallel_shard=4)


def _save_then_save_on_a_node_local_dir(shared: str, node1: str) -> dict[str, Any]:
    """Step 2 on the shared dir; step 4 with rank 1 writing where rank 0 cannot see (its own disk)."""
    ctx, model, opt = sharded_job(WORLD2)
    train_step(model, opt, 0)
    with CheckpointManager(shared, "run", context=ctx) as manager:
        manager.save(2, model, opt, extra_state={"step": 2}, rank_state={"rank": ctx.rank})
    # The same save_dir on two nodes without a shared file system: two different directories.
    own_disk = shared if ctx.rank == 0 else node1
    with CheckpointManager(own_disk, "run", context=ctx) as manager:
        try:
            manager.save(4, model, opt, extra_state={"step": 4}, rank_state={"rank": ctx.rank})
        except CheckpointError as exc:
            return {
                "type": type(exc).__name__,
                "error": str(exc),
                "left": sorted(os.listdir(Path(own_disk) / "run")),
            }
    return {"type": None, "error": None, "left": []}


def test_save_dir_not_shared_by_all_nodes_is_refused_at_commit(tmp_path):
    shared, node1 = tmp_path / "shared", tmp_path / "node1"
    results = run_distributed(_save_then_save_on_a_node_local_dir, 2, str(shared), str(node1))
    assert {r["type"] for r in results} == {"SaveDirNotSharedError"}
    message = one_error(results)
    assert message.startswith(
        f"save_dir {shared} is not on a file system shared by all nodes (rank 1's files are not visible "
        "to rank 0); put trainer.checkpointing.save_dir on a shared file system"
    ), message
    assert "__1_0.distcp is missing" in message and "rank-00001.msgpack is missing" in message
    # Nothing was committed: save-2 stays the latest, and no rank keeps the failed save's files.
    assert [c.step for c in list_checkpoints(shared / "run")] == [2]
    assert stale_dirs(shared / "run") == [] and stale_dirs(node1 / "run") == []
    assert results[1]["left"] == []


def _load(save_dir: str, verify: bool, config: MeshConfig = WORLD2) -> dict[str, Any]:
    ctx, model, opt = sharded_job(config, seed=3)
    with CheckpointManager(save_dir, "run", context=ctx, verify_on_load=verify) as manager:
        try:
            return {"step": manager.load(None, model, opt).step, "error": None}
        except CheckpointError as exc:
            return {"step": None, "type": type(exc).__name__, "error": str(exc)}


def _save_steps(save_dir: str, config: MeshConfig = WORLD2) -> None:
    ctx, model, opt = sharded_job(config)
    with CheckpointManager(save_dir, "run", context=ctx, async_save=True) as manager:
        for step in (2, 4):
            train_step(model, opt, step)
            manager.save(step, model, opt, extra_state={"step": step}, rank_state={"rank": ctx.rank})


def test_flipped_byte_in_rank1s_shard_is_one_error_on_every_rank(tmp_path):
    run_distributed(_save_steps, 2, str(tmp_path))
    for info in list_checkpoints(tmp_path / "run"):
        assert info.meta.checksums is not None and set(info.meta.checksums) == set(info.meta.files)
        assert {"__0_0.distcp", "__1_0.distcp", "rank-00001.msgpack"} <= set(info.meta.checksums)
    shard = tmp_path / "run" / "save-4" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert [r["step"] for r in run_distributed(_load, 2, str(tmp_path), False)] == [4, 4]  # not read
    results = run_distributed(_load, 2, str(tmp_path), True)
    assert {r["type"] for r in results} == {CheckpointDamagedError.__name__}
    assert {r["error"] for r in results} == {
        f"checkpoint {tmp_path / 'run' / 'save-4'} cannot be loaded (1 problem); the model's state is "
        "undefined (found while loading it): do not use it:\n"
        "  - save-4/__1_0.distcp is damaged (checksum mismatch); move save-4 aside to resume from save-2"
    }
    shutil.move(tmp_path / "run" / "save-4", tmp_path / "save-4.damaged")
    assert [r["step"] for r in run_distributed(_load, 2, str(tmp_path), True)] == [2, 2]


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """save-2 and save-4 written by 4 FSDP ranks."""
    save_dir = tmp_path_factory.mktemp("world4")
    run_distributed(_save_steps, 4, str(save_dir), WORLD4)
    return save_dir


def _damage_rank3s_shard(save_dir: Path, *, in_values: bool) -> Path:
    """Flip one byte of rank 3's part of `model.0.bias` in save-4's `__3_0.distcp`: in the tensor's
    values (DCP reads it without complaint: only its checksum tells) or in the item's first byte (the
    read fails). Returns save-4's path."""
    save = save_dir / "run" / "save-4"
    metadata = FileSystemReader(str(save)).read_metadata()
    (where,) = [
        s
        for i, s in metadata.storage_data.items()
        if i.fqn == "model.0.bias" and s.relative_path == "__3_0.distcp"
    ]
    data = bytearray((save / where.relative_path).read_bytes())
    item = bytes(data[where.offset : where.offset + where.length])
    at = where.offset + (item.index(torch.load(io.BytesIO(item)).numpy().tobytes()) if in_values else 0)
    data[at] ^= 0x40
    (save / where.relative_path).write_bytes(bytes(data))
    return save


def _refusal(save: Path) -> tuple[str, str]:
    return CheckpointDamagedError.__name__, (
        f"checkpoint {save} cannot be loaded (1 problem); the model's state is undefined (found while "
        "loading it): do not use it:\n"
        "  - save-4/__3_0.distcp is damaged (checksum mismatch); move save-4 aside to resume from save-2"
    )


def test_every_file_of_a_world4_checkpoint_has_a_verifying_rank_in_a_smaller_world(world4):
    (info,) = [c for c in list_checkpoints(world4 / "run") if c.step == 4]
    assert info.meta.checksums is not None
    assert {f"__{r}_0.distcp" for r in range(4)} | {f"rank-{r:05d}.msgpack" for r in range(4)} <= set(
        info.meta.checksums
    )
    for world in (1, 2, 3):
        assert {verifier_of(name, world) for name in info.meta.checksums} == set(range(world)), world


def test_a_flipped_value_in_rank3s_shard_is_refused_when_loading_on_2_ranks_and_on_1(world4, tmp_path):
    shutil.copytree(world4, tmp_path, dirs_exist_ok=True)
    save = _damage_rank3s_shard(tmp_path, in_values=True)
    # the read alone does not notice: a world of 2 (or 1) has no rank 3 to verify the file it wrote
    assert [r["step"] for r in run_distributed(_load, 2, str(tmp_path), False, WORLD2)] == [4, 4]
    two = run_distributed(_load, 2, str(tmp_path), True, WORLD2)
    assert [(r["type"], r["error"]) for r in two] == [_refusal(save)] * 2
    one = run_forked(_load, str(tmp_path), True, MeshConfig())  # one process, no process group
    assert (one["type"], one["error"]) == _refusal(save)
    shutil.move(save, tmp_path / "save-4.damaged")  # the healthy save-2 loads on 2 ranks
    assert [r["step"] for r in run_distributed(_load, 2, str(tmp_path), True, WORLD2)] == [2, 2]


def test_a_shard_that_breaks_the_read_on_2_ranks_is_one_line_on_every_rank(world4, tmp_path):
    shutil.copytree(world4, tmp_path, dirs_exist_ok=True)
    save = _damage_rank3s_shard(tmp_path, in_values=False)
    # verified: the checksum names the file, though the read failed first
    verified = run_distributed(_load, 2, str(tmp_path), True, WORLD2)
    assert [(r["type"], r["error"]) for r in verified] == [_refusal(save)] * 2
    # unverified: the read's own failure, one line, the same on every rank
    unverified = run_distributed(_load, 2, str(tmp_path), False, WORLD2)
    message = one_error(unverified)
    assert {r["type"] for r in unverified} == {CheckpointDamagedError.__name__}
    assert message.startswith(f"reading checkpoint {save} failed after it passed its checks (")
    assert message.endswith(  # rank 1 of 2 reads rows 4-7, so rank 3's rows 6-7 of the bias
        " (on rank 1)); the model state is undefined: load again, or move save-4 aside to resume from save-2"
    )
    assert "\n" not in message


def _rank1_disk_full(save_dir: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import filesystem

    ctx, model, opt = sharded_job(WORLD2)
    if ctx.rank == 1:

        def full(self, path, mode):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        filesystem.FileSystem.create_stream = full  # type: ignore[method-assign]
    with CheckpointManager(save_dir, "run", context=ctx) as manager:
        try:
            manager.save(2, model, opt)
        except CheckpointDiskFullError as exc:
            return {"error": str(exc)}
    return {"error": None}


def test_disk_full_on_one_rank_is_named_on_every_rank(tmp_path):
    results = run_distributed(_rank1_disk_full, 2, str(tmp_path))
    message = one_error(results)
    assert message.startswith(
        f"no space left on device while writing checkpoint step 2 to {tmp_path / 'run'}; the previous "
        "checkpoint stays the latest; free space or set trainer.checkpointing.save_dir (OSError: "
        "[Errno 28] No space left on device: "
    ), message
    assert message.endswith("__1_0.distcp' (on rank 1))"), message
    assert list_checkpoints(tmp_path / "run") == [] and stale_dirs(tmp_path / "run") == []
