"""Checkpoints of FSDP2-sharded models over real gloo ranks: resharding to other rank counts and meshes."""

import os
import re
import shutil
import signal
import threading
import time

import pytest
import torch
from _ckpt_testlib import adamw, eval_loss, full_params, sharded_job, tiny_model, train_step

from d9d.ckpt import CheckpointError, CheckpointManager, capture_rng_state
from d9d.ckpt.checkpoint._testhooks import PAUSE_BEFORE_COMMIT_ENV
from d9d.mesh import MeshConfig
from d9d.mesh.testing import DistributedTestError, run_distributed

SAVED_AT = 2


def _save_on_fsdp_ranks(save_dir: str, async_save: bool) -> dict:
    """Train, save at step 2, then continue: the reference every reloaded run must reproduce."""
    ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=2))
    for s in range(SAVED_AT):
        train_step(model, opt, s)
    manager = CheckpointManager(save_dir, "run", async_save=async_save, context=ctx)
    manager.save(
        SAVED_AT,
        model,
        opt,
        extra_state={"step": SAVED_AT, "data": {"epoch": 0, "position": 32}},
        rank_state={"rank": ctx.rank, "rng": capture_rng_state()},
    )
    saved = full_params(model)
    next_loss = train_step(model, opt, SAVED_AT)  # overlaps the write when async
    manager.close()
    return {"saved": saved, "next": (next_loss, eval_loss(model)), "after": full_params(model)}


def _load_and_continue(save_dir: str, config: MeshConfig) -> dict:
    ctx, model, opt = sharded_job(config, seed=7)  # a different initialization: loading must overwrite it
    with CheckpointManager(save_dir, "run", context=ctx) as manager:
        loaded = manager.load(manager.latest(), model, opt)
    restored = full_params(model)
    return {
        "restored": restored,
        "next": (train_step(model, opt, SAVED_AT), eval_loss(model)),
        "after": full_params(model),
        "extra": loaded.extra_state,
        "rank_state": loaded.rank_state,
        "meta": (loaded.info.meta.world_size, loaded.info.meta.mesh),
    }


def _assert_resumed(result: dict, reference: dict) -> None:
    for name, tensor in reference["saved"].items():
        torch.testing.assert_close(result["restored"][name], tensor, rtol=0, atol=0, msg=name)
    # The optimizer state came back too: the next AdamW step moves every parameter the same way.
    torch.testing.assert_close(result["next"], reference["next"], rtol=0, atol=1e-5)
    torch.testing.assert_close(result["after"], reference["after"], rtol=0, atol=1e-5)
    assert result["extra"] == {"step": SAVED_AT, "data": {"epoch": 0, "position": 32}}
    assert result["meta"][0] == 2 and result["meta"][1]["data_parallel_shard"] == 2


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    save_dir = str(tmp_path_factory.mktemp("fsdp2"))
    results = run_distributed(_save_on_fsdp_ranks, 2, save_dir, False)
    return save_dir, results[0]


def test_fsdp2_world2_loads_in_one_process(fsdp2_checkpoint):
    save_dir, reference = fsdp2_checkpoint
    result = _load_and_continue(save_dir, MeshConfig())
    _assert_resumed(result, reference)
    assert result["rank_state"] is None  # per-rank state only carries over to the same rank count


@pytest.mark.parametrize(
    "config",
    [
        MeshConfig(data_parallel_shard=2),
        MeshConfig(data_parallel_shard=3),
        MeshConfig(data_parallel_shard=4),
        MeshConfig(data_parallel_replicate=2, data_parallel_shard=2),
    ],
    ids=["fsdp_world2", "fsdp_world3", "fsdp_world4", "hsdp2x2_world4"],
)
def test_fsdp2_world2_loads_on_other_meshes(fsdp2_checkpoint, config):
    save_dir, reference = fsdp2_checkpoint
    results = run_distributed(_load_and_continue, config.world_size, save_dir, config)
    for result in results:
        _assert_resumed(result, reference)
    if config.world_size == 2:
        assert [r["rank_state"]["rank"] for r in results] == [0, 1]
    else:
        assert all(r["rank_state"] is None for r in results)


def test_async_save_world2_commits_the_state_at_save_time(tmp_path):
    reference = run_distributed(_save_on_fsdp_ranks, 2, str(tmp_path), True)[0]
    _assert_resumed(_load_and_continue(str(tmp_path), MeshConfig()), reference)


def _load_mismatched(save_dir: str) -> str:
    ctx, _, _ = sharded_job(MeshConfig(data_parallel_shard=2))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    mesh = ctx.mesh("dense")["dp_shard"]
    torch.distributed.fsdp.fully_shard(model, mesh=mesh)
    before = full_params(model)
    with CheckpointManager(save_dir, "run", context=ctx) as manager:
        try:
            manager.load(None, model)
        except CheckpointError as exc:
            after = full_params(model)
            assert all(torch.equal(before[k], after[k]) for k in before)
            return str(exc)
    raise AssertionError("loading a mismatched model did not fail")


def test_mismatch_is_one_error_on_every_rank_world2(fsdp2_checkpoint):
    save_dir, _ = fsdp2_checkpoint
    messages = run_distributed(_load_mismatched, 2, save_dir)
    assert messages[0] == messages[1]
    assert "shape mismatch at key model.2.weight" in messages[0] and "save-2" in messages[0]


def _save_with_a_failing_rank(save_dir: str) -> str:
    ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=2))
    manager = CheckpointManager(save_dir, "run", context=ctx)
    manager.save(1, model, opt)
    bad = {"rng": torch.zeros(1)} if ctx.rank == 1 else {"rng": b""}
    try:
        manager.save(2, model, opt, rank_state=bad)
    except CheckpointError as exc:
        assert manager.latest().step == 1
        return str(exc)
    finally:
        manager.close()
    raise AssertionError("a save with an unencodable rank state did not fail")


def test_a_rank_failing_alone_fails_the_save_on_every_rank_world2(tmp_path):
    messages = run_distributed(_save_with_a_failing_rank, 2, str(tmp_path), timeout=30)
    assert messages[0] == messages[1]
    assert "failed on rank 1" in messages[0] and "rank_state['rng']" in messages[0]


def _kill_rank0_before_commit(save_dir: str) -> None:
    ctx, model, opt = sharded_job(MeshConfig(data_parallel_shard=2))
    manager = CheckpointManager(save_dir, "run", context=ctx)
    manager.save(1, model, opt, extra_state={"step": 1})
    pids: list[int] = [0, 0]
    torch.distributed.all_gather_object(pids, os.getpid())
    run_dir = manager.run_dir
    if ctx.rank == 0:
        os.environ[PAUSE_BEFORE_COMMIT_ENV] = "60"  # rank 0 holds the commit once all ranks wrote
    else:

        def kill_rank0_once_written() -> None:
            while not any(run_dir.glob(".save-2.tmp-*/.metadata")):
                time.sleep(0.001)
            os.kill(pids[0], signal.SIGKILL)

        threading.Thread(target=kill_rank0_once_written, daemon=True).start()
    train_step(model, opt, 1)
    manager.save(2, model, opt, extra_state={"step": 2})


def test_sigkill_between_write_and_commit_world2_keeps_the_previous_checkpoint(tmp_path):
    with pytest.raises(DistributedTestError):  # rank 0 died; rank 1 lost its peer
        run_distributed(_kill_rank0_before_commit, 2, str(tmp_path), timeout=30)
    run_dir = tmp_path / "run"
    (written,) = run_dir.glob(".save-2.tmp-*")  # every shard of step 2 is there, but not committed
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in written.iterdir()}
    with CheckpointManager(tmp_path, "run") as manager:
        assert [i.step for i in manager.checkpoints()] == [1]
        model = tiny_model(seed=3)
        assert manager.load(None, model, adamw(model)).extra_state == {"step": 1}


def test_truncated_shard_of_a_world2_checkpoint_is_refused(fsdp2_checkpoint, tmp_path):
    save_dir, _ = fsdp2_checkpoint
    shutil.copytree(save_dir, tmp_path, dirs_exist_ok=True)
    shard = tmp_path / "run" / f"save-{SAVED_AT}" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    model = tiny_model(seed=7)
    before = full_params(model)
    with CheckpointManager(tmp_path, "run") as manager, pytest.raises(CheckpointError) as err:
        manager.load(None, model, adamw(model))
    message = str(err.value)
    assert f"checkpoint {tmp_path / 'run' / 'save-2'} cannot be loaded" in message
    assert re.search(
        r"save-2/__1_0\.distcp is truncated: \d+ bytes, the commit recorded \d+; it holds keys model\.",
        message,
    )
    assert all(torch.equal(before[k], v) for k, v in full_params(model).items())
