"""Extra state encoding (plain data only) and RNG capture/restore."""

import random

import numpy as np
import pytest
import torch

from d9d.ckpt import CheckpointError, capture_rng_state, restore_rng_state
from d9d.ckpt.checkpoint.extra import decode_state, encode_state


def _draw() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_plain_data_round_trips():
    state = {
        "step": 3,
        "lr": 1e-3,
        "name": "x",
        "flag": True,
        "none": None,
        "blob": b"\x00\xff",
        "nested": {"a": [1, 2.5]},
    }
    assert decode_state(encode_state(state, "extra_state"), "f") == state


def test_unencodable_value_is_named_by_its_key_path():
    with pytest.raises(CheckpointError, match=r"extra_state\['data'\]\['pos'\]\[1\] \(Tensor\)"):
        encode_state({"data": {"pos": [1, torch.zeros(2)]}}, "extra_state")


def test_corrupt_bytes_are_a_clear_error():
    data = encode_state({"step": 1, "blob": b"x" * 100}, "extra_state")
    with pytest.raises(CheckpointError, match=r"extra\.msgpack is corrupt"):
        decode_state(data[: len(data) // 2], "extra.msgpack")


def test_rng_state_survives_encoding_and_restores_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = decode_state(encode_state({"rng": capture_rng_state()}, "rank_state"), "f")["rng"]
    expected = _draw()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert _draw() != expected
    restore_rng_state(state)
    assert _draw() == expected


class _FakeCuda:
    """torch.cuda's RNG calls for a process that sees `visible` GPUs and uses `current`: each device a
    generator of its own (its state: 16 bytes naming the device and a counter)."""

    def __init__(self, visible: int, current: int) -> None:
        self.visible, self.current = visible, current
        self.states = {i: bytes([i, 0] * 8) for i in range(visible)}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("is_available", "is_initialized"):
            monkeypatch.setattr(torch.cuda, name, lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        for name in ("get_rng_state_all", "set_rng_state_all"):  # what failed on fewer visible GPUs
            monkeypatch.setattr(torch.cuda, name, self.refuse)

    def get(self, device: str = "cuda") -> torch.Tensor:
        assert device == "cuda"
        return torch.frombuffer(bytearray(self.states[self.current]), dtype=torch.uint8)

    def set(self, state: torch.Tensor, device: str = "cuda") -> None:
        assert device == "cuda"
        if self.current >= self.visible:
            raise RuntimeError(f"invalid device ordinal {self.current}")
        self.states[self.current] = state.numpy().tobytes()

    def refuse(self, *args: object) -> None:
        raise AssertionError("the RNG state of every visible GPU was read or written")


def _round_trip(state: dict) -> dict:
    return decode_state(encode_state({"rng": state}, "rank_state"), "f")["rng"]


def test_cuda_rng_keeps_the_current_device_and_resumes_on_fewer_visible_gpus(monkeypatch):
    saver = _FakeCuda(visible=8, current=5)  # rank 5 of a node whose processes each see 8 GPUs
    saver.install(monkeypatch)
    state = _round_trip(capture_rng_state())
    assert state["cuda_device"] == saver.states[5] and "cuda" not in state
    resumer = _FakeCuda(visible=1, current=0)  # the same rank with CUDA_VISIBLE_DEVICES=5
    resumer.install(monkeypatch)
    restore_rng_state(state)
    assert resumer.states[0] == saver.states[5]


def test_cuda_rng_of_an_older_checkpoint_sets_the_current_device_from_its_list(monkeypatch):
    old = _FakeCuda(visible=4, current=2)
    state = _round_trip({**capture_rng_state(), "cuda": [old.states[i] for i in range(4)]})
    again = _FakeCuda(visible=4, current=2)
    again.states = {i: b"\xff" * 16 for i in range(4)}
    again.install(monkeypatch)
    restore_rng_state(state)
    assert again.states[2] == old.states[2]
    assert [again.states[i] for i in (0, 1, 3)] == [b"\xff" * 16] * 3  # only the device in use
    fewer = _FakeCuda(visible=1, current=0)
    fewer.install(monkeypatch)
    restore_rng_state(state)  # the old set_rng_state_all failed here (4 states, 1 device)
    assert fewer.states[0] == old.states[0]
