"""Async saves stage into host buffers that later saves reuse; pinned only where CUDA is."""

from typing import Any

import pytest
import torch
from _ckpt_testlib import adamw, run_forked, tiny_model, train_step
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.staging import DefaultStager

from d9d.ckpt import CheckpointManager
from d9d.ckpt.checkpoint import staging
from d9d.ckpt.checkpoint.staging import HostStaging, state_on_cuda


def test_cpu_state_reuses_one_unpinned_stager():
    state = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {"w": [torch.zeros(3)]}}}
    host = HostStaging()
    first = host.stager(state)
    assert isinstance(first, DefaultStager) and host.stager(state) is first
    assert not host.pinned and not state_on_cuda(state)
    host.close()
    assert HostStaging(reuse=False).stager(state) is None  # DCP's default: a fresh copy per save


def test_cuda_state_is_staged_pinned_with_non_blocking_copies(monkeypatch):
    with FakeTensorMode():
        cuda_state = {"model": {"w": torch.empty(4, device="cuda")}, "step": 3}
    assert state_on_cuda(cuda_state)
    seen: list[Any] = []

    class _Recorder:
        def __init__(self, options: Any) -> None:
            seen.append(options)

        def close(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staging, "reusable_stager", _Recorder)
    host = HostStaging()
    host.stager(cuda_state)
    (options,) = seen
    assert options.use_pinned_memory and options.use_non_blocking_copy and host.pinned
    # The copy finishes inside `save` (training may then change the tensors); the writer is a thread.
    assert not options.use_async_staging and not options.use_shared_memory


def _saves_reuse_the_buffers(save_dir: str, reuse: bool) -> dict[str, Any]:
    staged: list[set[int]] = []

    make = staging.reusable_stager

    def recording(options: Any) -> DefaultStager:
        stager = make(options)
        stage = stager.stage

        def recorded(state_dict: Any, **kwargs: Any) -> Any:
            out = stage(state_dict, **kwargs)
            staged.append({t.untyped_storage().data_ptr() for t in _leaves(out) if t.numel() > 1})
            return out

        stager.stage = recorded  # type: ignore[method-assign]
        return stager

    staging.reusable_stager = recording  # (in a forked process: nothing to restore)
    model = tiny_model()
    opt = adamw(model)
    train_step(model, opt, 0)
    manager = CheckpointManager(save_dir, "run", async_save=True, reuse_staging=reuse)
    expected = {}
    for step in (1, 2, 3):
        manager.save(step, model, opt, extra_state={"step": step})
        expected[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train_step(model, opt, step)  # overlaps the write and changes every tensor
    manager.close()
    loaded = {}
    with CheckpointManager(save_dir, "run") as reader:
        for info in reader.checkpoints():
            fresh = tiny_model(seed=9)
            reader.load(info, fresh, adamw(fresh))
            loaded[info.step] = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    return {"staged": staged, "expected": expected, "loaded": loaded, "pinned": manager.staging_pinned}


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _leaves(v)]
    return []


@pytest.mark.parametrize("reuse", [True, False], ids=["reused", "fresh"])
def test_async_saves_on_cpu_commit_the_state_at_save_time(tmp_path, reuse):
    result = run_forked(_saves_reuse_the_buffers, str(tmp_path), reuse)
    assert sorted(result["loaded"]) == [1, 2, 3]
    for step, params in result["expected"].items():
        for key, tensor in params.items():
            assert torch.equal(result["loaded"][step][key], tensor), (step, key)
    assert result["pinned"] is False  # no CUDA here: nothing is pinned
    if reuse:  # every save copied into the buffers the first one allocated
        first, *later = result["staged"]
        assert len(later) == 2 and all(ptrs == first for ptrs in later) and len(first) >= 6
    else:
        assert result["staged"] == []  # DCP's own stager, created per save
