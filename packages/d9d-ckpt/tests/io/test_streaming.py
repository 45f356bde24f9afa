"""Streaming order: a shard is written before later groups are mapped; files are read one at a time."""

from collections.abc import Mapping

import safetensors.torch
import torch

import d9d.ckpt.io._read as read_module
from d9d.ckpt import (
    MappingGroup,
    Parallel,
    StateMapper,
    Transpose,
    identity_map,
    load_safetensors,
    save_safetensors,
)


class _Spy(StateMapper):
    """Wraps a mapper and logs every group it applies."""

    def __init__(self, inner: StateMapper, log: list[str]) -> None:
        self.inner = inner
        self.log = log
        self._set_groups(inner.groups())

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if next(iter(tensors.values())).device.type != "meta":  # the planning dry run touches no data
            self.log.append("map " + ",".join(sorted(group.outputs)))
        return self.inner.apply(tensors)

    def direct_sources(self) -> dict[str, str]:
        return self.inner.direct_sources()


def _state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4, 4), float(i)) for i in range(6)}  # 64 bytes each


def test_each_shard_is_written_as_soon_as_it_is_full(tmp_path, monkeypatch):
    log: list[str] = []
    real_save = safetensors.torch.save_file

    def logged_save(tensors, path, metadata=None):
        log.append(f"write {sorted(tensors)}")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", logged_save)
    state = _state()
    save_safetensors(state, tmp_path, mapper=_Spy(identity_map(state), log), max_shard_size=128)
    assert log == [
        "map w0", "map w1", "write ['w0', 'w1']",
        "map w2", "map w3", "write ['w2', 'w3']",
        "map w4", "map w5", "write ['w4', 'w5']",
    ]  # fmt: skip


def test_files_are_read_one_at_a_time(tmp_path, monkeypatch):
    state = _state()
    save_safetensors(state, tmp_path, max_shard_size=128)
    log: list[str] = []
    open_now = [0]
    real_open = read_module.safe_open

    class _Logged:
        def __init__(self, path, framework):
            self.path = path
            self.handle = real_open(path, framework=framework)

        def __enter__(self):
            open_now[0] += 1
            assert open_now[0] == 1, "two files open at once"
            self.inner = self.handle.__enter__()
            return self.inner

        def __exit__(self, *exc):
            open_now[0] -= 1
            log.append(f"close {self.path.name}")
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(read_module, "safe_open", _Logged)
    target = {k: torch.zeros(4, 4) for k in state}
    renames = identity_map([k for k in state if k != "w3"])
    load_safetensors(target, tmp_path, mapper=_Spy(Parallel([renames, Transpose("w3")]), log))
    assert log[:3] == [f"close model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # headers only
    assert log[3:] == [  # then the data, file by file; plain renames are read straight into the target
        "close model-00001-of-00003.safetensors",
        "map w3",
        "close model-00002-of-00003.safetensors",
        "close model-00003-of-00003.safetensors",
    ]
    assert all(torch.equal(target[k], state[k].T if k == "w3" else state[k]) for k in state)
