"""Host-to-device defaults: when batches are pinned, and non-blocking moves of nested batches."""

from collections import namedtuple

import pytest
import torch

from d9d.data import pin_memory_enabled, to_device


@pytest.mark.parametrize(
    ("setting", "device", "with_cuda", "expected"),
    [
        ("auto", torch.device("cuda", 0), True, True),
        ("auto", torch.device("cpu"), True, False),
        ("auto", None, True, False),
        (True, None, True, True),
        (False, torch.device("cuda", 0), True, False),
        ("auto", torch.device("cuda", 0), False, False),  # pinning needs a usable CUDA runtime
        (True, torch.device("cuda", 0), False, False),
    ],
)
def test_pin_memory_follows_the_setting_and_the_device(monkeypatch, setting, device, with_cuda, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: with_cuda)
    assert pin_memory_enabled(setting, device) is expected


def test_to_device_moves_every_tensor_of_a_nested_batch_and_keeps_its_structure():
    Pair = namedtuple("Pair", ["a", "b"])
    batch = {
        "input_ids": torch.ones(2, 3),
        "extra": [torch.zeros(1), (torch.zeros(2), "tag")],
        "p": Pair(torch.ones(1), 3),
    }
    moved = to_device(batch, "meta")
    assert moved["input_ids"].device.type == "meta" and moved["input_ids"].shape == (2, 3)
    assert moved["extra"][0].is_meta and moved["extra"][1][0].is_meta and moved["extra"][1][1] == "tag"
    assert isinstance(moved["p"], Pair) and moved["p"].a.is_meta and moved["p"].b == 3
    same = torch.ones(2)
    assert to_device([same], torch.device("cpu"))[0] is same
