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
