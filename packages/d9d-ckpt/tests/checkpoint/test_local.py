"""CheckpointManager in one plain process (local mode: no process group)."""

import shutil

import pytest
import torch
from _ckpt_testlib import adamw, eval_loss, full_params, run_forked, tiny_model, train_step
from torch import nn

from d9d.ckpt import CheckpointDamagedError, CheckpointError, CheckpointManager, capture_rng_state
from d9d.ckpt.checkpoint.layout import COMMIT_FILE, stale_dirs, temp_dir_name


def _trained(steps: int = 2, seed: int = 0):
    model = tiny_model(seed)
    opt = adamw(model)
    for s in range(steps):
        train_step(model, opt, s)
    return model, opt


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_round_trip_restores_model_optimizer_and_state(tmp_path):
    model, opt = _trained()
    extra = {"step": 2, "data": {"epoch": 0, "position": 32}, "config": {"optimizer": {"lr": 0.01}}}
    rng = capture_rng_state()
    with CheckpointManager(tmp_path, "run") as manager:
        info = manager.save(2, model, opt, extra_state=extra, rank_state={"rng": rng})
        saved = full_params(model)
        expected_loss = (train_step(model, opt, 2), eval_loss(model))

        fresh, fresh_opt = tiny_model(seed=5), None
        fresh_opt = adamw(fresh)
        assert info is not None and manager.latest() == info
        loaded = manager.load(info, fresh, fresh_opt)

    assert loaded.step == 2 and loaded.extra_state == extra and loaded.rank_state == {"rng": rng}
    assert info.meta.world_size == 1 and info.meta.has_optimizer and info.meta.mesh is None
    assert {"extra.msgpack", "rank-00000.msgpack", ".metadata"} <= set(info.meta.files)
    assert info.path == tmp_path / "run" / "save-2"
    _assert_same_params(full_params(fresh), saved)
    assert (train_step(fresh, fresh_opt, 2), eval_loss(fresh)) == expected_loss


def test_retention_keeps_the_newest_and_deletes_only_after_a_commit(tmp_path):
    model, opt = _trained(1)
    manager = CheckpointManager(tmp_path, "run", num_to_keep=2)
    seen = []
    for step in (10, 20, 30, 40):
        manager.save(step, model, opt, extra_state={"step": step})
        seen.append([i.step for i in manager.checkpoints()])
    assert seen == [[10], [10, 20], [20, 30], [30, 40]]

    with pytest.raises(CheckpointError, match=r"extra_state\['bad'\]"):
        manager.save(50, model, opt, extra_state={"bad": object()})
    assert [i.step for i in manager.checkpoints()] == [30, 40]  # a failed save removes nothing

    # Saving an older step (after loading an old checkpoint) never deletes the one just written.
    manager.save(35, model, opt, extra_state={"step": 35})
    assert [i.step for i in manager.checkpoints()] == [35, 40]
    assert manager.latest().step == 40
    assert sorted(p.name for p in manager.run_dir.iterdir()) == ["save-35", "save-40"]


def test_saving_a_step_again_replaces_it(tmp_path):
    model, opt = _trained(1)
    manager = CheckpointManager(tmp_path, "run")
    manager.save(5, model, opt, extra_state={"version": 1})
    manager.save(5, model, None, extra_state={"version": 2})
    assert [i.step for i in manager.checkpoints()] == [5]
    assert manager.load().extra_state == {"version": 2}
    assert sorted(p.name for p in manager.run_dir.iterdir()) == ["save-5"]


def test_unfinished_saves_are_never_loaded_and_are_removed_after_the_next_commit(tmp_path):
    model, opt = _trained(1)
    manager = CheckpointManager(tmp_path, "run")
    manager.save(2, model, opt, extra_state={"step": 2})
    manager.wait()  # its background cleanup is done before the "crashed" leftovers appear
    committed = manager.run_dir / "save-2"
    # A crash after writing everything, before the rename; and a renamed copy that lost its marker.
    stale = manager.run_dir / temp_dir_name(9, "0123abcd")
    shutil.copytree(committed, stale)
    unmarked = manager.run_dir / "save-8"
    shutil.copytree(committed, unmarked)
    (unmarked / COMMIT_FILE).unlink()

    assert manager.latest().step == 2
    fresh = tiny_model()
    assert manager.load(None, fresh, adamw(fresh)).step == 2
    assert stale_dirs(manager.run_dir) == [stale]

    manager.save(3, model, opt, extra_state={"step": 3})
    manager.wait()  # the cleanup after a commit runs in the background
    assert stale_dirs(manager.run_dir) == []
    assert not stale.exists()
    assert [i.step for i in manager.checkpoints()] == [2, 3]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "truncate",
            r"save-2/__0_0\.distcp is truncated: \d+ bytes, the commit recorded \d+; it holds keys model\.0\.bias, ",
        ),
        ("delete", r"save-2/__0_0\.distcp is missing .*; it holds keys model\.0\.bias"),
        ("scramble_metadata", r"torch\.distributed\.checkpoint metadata cannot be read"),
        ("scramble_extra", r"save-2/extra\.msgpack is corrupt"),
    ],
)
def test_damaged_checkpoint_is_refused_and_nothing_is_loaded(tmp_path, damage, message):
    model, opt = _trained()
    manager = CheckpointManager(tmp_path, "run")
    info = manager.save(2, model, opt, extra_state={"step": 2, "blob": b"x" * 64})
    if damage == "truncate":
        shard = info.path / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "delete":
        (info.path / "__0_0.distcp").unlink()
    else:
        target = info.path / (".metadata" if damage == "scramble_metadata" else "extra.msgpack")
        target.write_bytes(b"\xc1" * target.stat().st_size)  # same size, garbage bytes

    other, other_opt = tiny_model(seed=3), None
    other_opt = adamw(other)
    before = full_params(other)
    with pytest.raises(CheckpointError, match=message) as err:
        manager.load(info, other, other_opt)
    assert str(info.path) in str(err.value) and "nothing was loaded" in str(err.value)
    assert isinstance(err.value, CheckpointDamagedError)
    assert str(err.value).endswith(
        "; move save-2 aside to start the run afresh (it has no earlier committed checkpoint)"
    )
    _assert_same_params(full_params(other), before)
    assert other_opt.state_dict()["state"] == {}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)),
            r"shape mismatch at key model\.2\.weight: the checkpoint holds \[5, 8\], the model expects \[4, 8\]",
        ),
        (
            lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Linear(5, 5)),
            r"missing key model\.3\.weight",
        ),
        (lambda: nn.Sequential(nn.Linear(6, 8)), r"unexpected key model\.2\.bias"),
        (
            lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double(),
            r"dtype mismatch at key model\.0\.bias",
        ),
    ],
)
def test_model_that_does_not_fit_is_refused_and_left_untouched(tmp_path, build, message):
    model, _ = _trained()
    manager = CheckpointManager(tmp_path, "run")
    info = manager.save(2, model)
    other = build()
    before = full_params(other)
    with pytest.raises(CheckpointError, match=message) as err:
        manager.load(info, other)
    assert str(info.path) in str(err.value)
    _assert_same_params(full_params(other), before)


def _cast_states(opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Every per-parameter state of `opt` in `dtype` (as an optimizer with bfloat16 states keeps them)."""
    for state in opt.state.values():
        for key in [k for k in state if k != "step"]:
            state[key] = state[key].to(dtype)


def _moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s[k].clone() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize(
    ("saved", "loaded"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_optimizer_states_load_across_a_float_dtype_and_nothing_else_may_change_dtype(
    tmp_path, saved, loaded
):
    model, opt = _trained()
    _cast_states(opt, saved)
    manager = CheckpointManager(tmp_path, "run")
    info = manager.save(2, model, opt)
    want = _moments(opt)
    other, other_opt = _trained(seed=3)
    _cast_states(other_opt, loaded)
    manager.load(info, other, other_opt)  # the load casts into the live states' dtype
    _assert_same_params(full_params(other), full_params(model))
    for got, expected in zip(_moments(other_opt), want, strict=True):
        # torch's load_state_dict then casts to the parameter's dtype (float32): the bfloat16 values exactly
        assert torch.equal(got, expected.to(torch.bfloat16).float())
    _cast_states(other_opt, torch.int32)  # not a float dtype: refused
    with pytest.raises(CheckpointError, match=r"dtype mismatch at key optimizer\.state\.0\.weight\.exp_avg"):
        manager.load(info, other, other_opt)
    manager.close()


def test_clear_errors_for_absent_or_model_only_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, "run")
    assert manager.latest() is None and manager.checkpoints() == []
    with pytest.raises(CheckpointError, match="there is no committed checkpoint in"):
        manager.load(None, tiny_model())
    model, _ = _trained(1)
    info = manager.save(1, model)
    fresh = tiny_model()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        manager.load(info, fresh, adamw(fresh))
    assert manager.load(info).extra_state == {}  # extra state alone, no model
    with pytest.raises(CheckpointError, match="run name"):
        CheckpointManager(tmp_path, "a/b")
    with pytest.raises(CheckpointError, match="num_to_keep"):
        CheckpointManager(tmp_path, "run", num_to_keep=0)


def _async_save_then_keep_training(save_dir: str) -> dict:
    model, opt = _trained()
    manager = CheckpointManager(save_dir, "run", async_save=True)
    assert manager.save(2, model, opt, extra_state={"step": 2}) is None
    assert manager.pending
    saved = full_params(model)
    for s in range(2, 5):  # the next steps overlap the write and change every tensor
        train_step(model, opt, s)
    info = manager.wait()
    assert not manager.pending and manager.latest() == info and info.step == 2
    fresh = tiny_model(seed=9)
    loaded = manager.load(info, fresh)
    manager.save(5, model, opt, extra_state={"step": 5})
    manager.close()  # waits for the pending save and commits it
    return {
        "saved": saved,
        "loaded": full_params(fresh),
        "extra": loaded.extra_state,
        "steps": [i.step for i in CheckpointManager(save_dir, "run").checkpoints()],
    }


def test_async_save_snapshots_the_state_and_commits_when_written(tmp_path):
    # Forked: the background threads of an async save must not exist in the pytest process.
    result = run_forked(_async_save_then_keep_training, str(tmp_path))
    _assert_same_params(result["loaded"], result["saved"])
    assert result["extra"] == {"step": 2}
    assert result["steps"] == [2, 5]


def _partly_frozen(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    model[0].requires_grad_(False)  # the "base" layer: frozen, like the weights under LoRA adapters
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def test_trainable_only_leaves_frozen_parameters_out_and_loads_just_the_rest(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    model, opt = _partly_frozen(0)
    for s in range(2):
        train_step(model, opt, s)
    with CheckpointManager(tmp_path, "run") as manager:
        info = manager.save(2, model, opt, extra_state={"step": 2}, trainable_only=True)
        expected = (train_step(model, opt, 2), eval_loss(model))
        fresh, fresh_opt = _partly_frozen(0)  # the caller rebuilds the frozen weights (same seed)
        frozen_before = fresh[0].weight.detach().clone()
        manager.load(info, fresh, fresh_opt)
        stored = set(FileSystemReader(str(info.path)).read_metadata().state_dict_metadata)

    assert info.meta.trainable_only
    assert not any(key.startswith("model.0.") for key in stored), sorted(stored)
    assert {"model.2.weight", "model.2.bias"} <= stored
    assert not any(".0." in key for key in stored if key.startswith("optimizer."))
    torch.testing.assert_close(fresh[0].weight, frozen_before, rtol=0, atol=0)
    assert (train_step(fresh, fresh_opt, 2), eval_loss(fresh)) == expected


def test_trainable_only_also_leaves_out_the_second_name_of_a_shared_frozen_parameter(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight  # a tied head, frozen like the base under LoRA
    model[0].requires_grad_(False)
    with CheckpointManager(tmp_path, "run") as manager:
        info = manager.save(1, model, trainable_only=True)
        manager.load(info, model)
    stored = set(FileSystemReader(str(info.path)).read_metadata().state_dict_metadata)
    assert stored == {"model.1.weight", "model.1.bias"}


def test_a_full_checkpoint_is_not_trainable_only(tmp_path):
    model, opt = _trained(1)
    with CheckpointManager(tmp_path, "run") as manager:
        assert not manager.save(1, model, opt).meta.trainable_only
