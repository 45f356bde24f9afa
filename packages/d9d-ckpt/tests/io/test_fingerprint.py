"""`safetensors_fingerprint`: which weights a folder holds, from its headers and samples of its data."""

import json

import pytest
import torch
from safetensors.torch import save_file

from d9d.ckpt import SafetensorsIOError, safetensors_fingerprint


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(512, 512, generator=gen), "b": torch.randn(300, generator=gen)}


def test_the_same_weights_give_the_same_fingerprint_and_other_values_another(tmp_path):
    one, two, other = tmp_path / "one", tmp_path / "two", tmp_path / "other"
    for folder, seed in ((one, 0), (two, 0), (other, 1)):
        folder.mkdir()
        save_file(_weights(seed), str(folder / "model.safetensors"))
    assert safetensors_fingerprint(one) == safetensors_fingerprint(two)
    assert safetensors_fingerprint(one) != safetensors_fingerprint(other)  # same names, shapes, dtypes
    save_file({"x": torch.zeros(2)}, str(one / "unrelated.safetensors"))  # not a file the loader reads
    assert safetensors_fingerprint(one) == safetensors_fingerprint(two)


def test_a_sharded_folder_is_fingerprinted_through_its_index(tmp_path):
    weights = _weights(0)
    save_file({"a": weights["a"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": weights["b"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    before = safetensors_fingerprint(tmp_path)
    save_file({"b": weights["b"] + 1}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert safetensors_fingerprint(tmp_path) != before


def test_a_missing_or_broken_file_is_one_error(tmp_path):
    with pytest.raises(SafetensorsIOError):
        safetensors_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsIOError, match="not a safetensors file"):
        safetensors_fingerprint(tmp_path)
