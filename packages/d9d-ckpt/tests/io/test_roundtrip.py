"""Single-process export and import: bit-exact round-trips, the sharded layout, mappers, errors."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from d9d.ckpt import (
    Chunk,
    Deduplicate,
    Identity,
    MappingError,
    Parallel,
    RopePermute,
    SafetensorsIOError,
    Sequential,
    Stack,
    UnusedKeysWarning,
    check_safetensors,
    identity_map,
    load_safetensors,
    rename_pattern,
    safetensors_shapes,
    save_safetensors,
)

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(_INT_OF[a.dtype]), b.view(_INT_OF[b.dtype]))
    )


def _awkward(dtype: torch.dtype, n: int = 64) -> torch.Tensor:
    """Values that a lossy path would change: nan, infinities, -0.0, the smallest subnormal, random bits."""
    info = torch.finfo(dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, info.tiny, info.max]).to(dtype)
    special = torch.cat([special, torch.tensor([info.smallest_normal]).to(dtype) / 2])
    random = torch.randn(n - len(special), generator=torch.Generator().manual_seed(1)).to(dtype)
    return torch.cat([special, random])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_roundtrip_bit_exactly(tmp_path, dtype):
    state = {"a": _awkward(dtype).reshape(8, 8), "b": _awkward(dtype, 9)}
    save_safetensors(state, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    load_safetensors(target, tmp_path)
    assert all(_bits_equal(target[k], state[k]) for k in state)


class _Tiny(nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def _model(seed: int, tied: bool = True) -> _Tiny:
    torch.manual_seed(seed)
    return _Tiny(tied)


def test_sharded_layout_and_index_are_consistent(tmp_path):
    model = _model(0, tied=False)
    state = model.state_dict()
    weight_map = save_safetensors(model, tmp_path, max_shard_size=200)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    count = len(files)
    assert count > 2
    assert files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map) == set(state)
    total = 0
    for name in files:
        loaded = safetensors.torch.load_file(tmp_path / name)  # plain HF tooling reads it
        assert set(loaded) == {k for k, f in weight_map.items() if f == name}
        nbytes = sum(t.numel() * t.element_size() for t in loaded.values())
        assert nbytes <= 200 or len(loaded) == 1
        total += nbytes
        for key, tensor in loaded.items():
            assert torch.equal(tensor, state[key])
        with safe_open(tmp_path / name, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    assert index["metadata"]["total_size"] == total
    fresh = _model(1, tied=False)
    load_safetensors(fresh, tmp_path)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in state.items())


def test_stale_files_of_a_previous_export_are_replaced(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_safetensors(_model(0), tmp_path, max_shard_size=100)
    save_safetensors(_model(0), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_tied_weights_roundtrip_and_stay_tied(tmp_path):
    model = _model(0)
    weight_map = save_safetensors(model, tmp_path, max_shard_size=150)
    assert weight_map["embed.weight"] != weight_map["head.weight"]  # the two names land in different shards
    fresh = _model(1)
    load_safetensors(fresh, tmp_path)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_tied_weights_stored_once_hf_style_and_loaded_into_both_names(tmp_path):
    model = _model(0)
    keys = [k for k in model.state_dict() if k not in ("embed.weight", "head.weight")]
    to_hf = Parallel(
        [Deduplicate(["embed.weight", "head.weight"], "model.embed_tokens.weight"), identity_map(keys)]
    )
    save_safetensors(model, tmp_path, mapper=to_hf)
    assert "head.weight" not in safetensors.torch.load_file(tmp_path / "model.safetensors")
    fresh = _model(1)
    load_safetensors(fresh, tmp_path, mapper=to_hf.inverse())
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.head.weight, model.embed.weight)


def test_tied_weights_in_one_shard_are_written_as_copies(tmp_path):
    model = _model(0)
    save_safetensors(model, tmp_path)
    loaded = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["head.weight"], loaded["embed.weight"])


def test_non_contiguous_tensors_roundtrip(tmp_path):
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    state = {"t": base.T, "strided": base[::2, 1::3], "slice": base[2:4]}
    assert not state["t"].is_contiguous() and not state["strided"].is_contiguous()
    save_safetensors(state, tmp_path)
    target_base = torch.zeros(6, 8, dtype=torch.bfloat16)
    target = {
        "t": target_base.T,
        "strided": torch.zeros(3, 3, dtype=torch.bfloat16),
        "slice": torch.zeros(2, 8, dtype=torch.bfloat16),
    }
    load_safetensors(target, tmp_path)
    assert all(_bits_equal(target[k], state[k]) for k in state)
    assert _bits_equal(target_base, base)  # written through the transposed view


class _Moe(nn.Module):
    """Our layout: fused qkv in interleaved RoPE order, grouped expert weights."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(8, 24, bias=False)}) for _ in range(2))
        self.experts = nn.Parameter(torch.randn(3, 4, 8))
        self.norm = nn.LayerNorm(8)


def _hf_mapper(model: nn.Module) -> Parallel:
    keys = list(model.state_dict())
    per_layer = [
        Sequential(
            [
                Chunk(f"layers.{i}.qkv.weight", [f"model.layers.{i}.{p}_proj.weight" for p in "qkv"]),
                Parallel(
                    [
                        RopePermute(f"model.layers.{i}.q_proj.weight", 4),
                        RopePermute(f"model.layers.{i}.k_proj.weight", 4),
                        Identity(f"model.layers.{i}.v_proj.weight"),
                    ]
                ),
            ]
        )
        for i in range(2)
    ]
    experts = Stack([f"model.experts.{e}.weight" for e in range(3)], "experts").inverse()
    norm = rename_pattern(r"norm\.(weight|bias)", r"model.norm.\1", keys)
    return Parallel([*per_layer, experts, norm])


def test_export_in_hf_names_and_load_back_with_the_inverse(tmp_path):
    torch.manual_seed(0)
    model = _Moe()
    mapper = _hf_mapper(model)
    weight_map = save_safetensors(model, tmp_path, mapper=mapper, max_shard_size=300)
    assert "model.layers.1.k_proj.weight" in weight_map and "model.experts.2.weight" in weight_map
    loaded = {}
    for name in set(weight_map.values()):
        loaded.update(safetensors.torch.load_file(tmp_path / name))
    assert torch.equal(loaded["model.experts.2.weight"], model.experts[2])
    assert torch.equal(loaded["model.layers.0.v_proj.weight"], model.layers[0]["qkv"].weight[16:])
    torch.manual_seed(1)
    fresh = _Moe()
    load_safetensors(fresh, tmp_path, mapper=mapper.inverse())
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key


def test_load_casts_to_the_target_dtype(tmp_path):
    state = {"w": torch.randn(4, 4).to(torch.bfloat16)}
    save_safetensors(state, tmp_path)
    target = {"w": torch.zeros(4, 4)}
    load_safetensors(target, tmp_path)
    assert torch.equal(target["w"], state["w"].float())


def test_folder_without_model_files_names_the_folder(tmp_path):
    with pytest.raises(SafetensorsIOError, match=f"{tmp_path} holds neither model.safetensors.index.json"):
        load_safetensors({"w": torch.zeros(1)}, tmp_path)


def test_index_naming_a_missing_file_is_an_error(tmp_path):
    weight_map = save_safetensors(_model(0, tied=False), tmp_path, max_shard_size=200)
    second = sorted(set(weight_map.values()))[1]
    (tmp_path / second).unlink()
    with pytest.raises(SafetensorsIOError, match=f"names '{second}', which is not in"):
        load_safetensors(_model(1, tied=False), tmp_path)


def test_a_layout_file_the_index_does_not_name_is_refused(tmp_path):
    weight_map = save_safetensors(_model(0, tied=False), tmp_path, max_shard_size=200)
    count = len(set(weight_map.values()))
    stray = f"model-00001-of-{count + 1:05d}.safetensors"  # a shard of another export
    safetensors.torch.save_file({"x": torch.zeros(1)}, str(tmp_path / stray))
    with pytest.raises(SafetensorsIOError, match=f"{stray} is not named by .*index.json.*remove the files"):
        load_safetensors(_model(1, tied=False), tmp_path)


def test_shards_without_their_index_are_refused(tmp_path):
    save_safetensors(_model(0, tied=False), tmp_path, max_shard_size=200)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(SafetensorsIOError, match=r"holds shards .* but no model\.safetensors\.index\.json"):
        load_safetensors(_model(1, tied=False), tmp_path)


def test_check_safetensors_checks_a_meta_target_without_reading(tmp_path):
    save_safetensors({"a": torch.ones(3, 4), "b": torch.ones(2)}, tmp_path)
    assert safetensors_shapes(tmp_path) == {"a": (3, 4), "b": (2,)}
    meta = {"a": torch.empty(3, 4, device="meta"), "b": torch.empty(2, device="meta")}
    check_safetensors(meta, tmp_path)
    meta["b"] = torch.empty(5, device="meta")
    with pytest.raises(SafetensorsIOError, match=r"'b' of the target has shape \(5,\)"):
        check_safetensors(meta, tmp_path)
    with pytest.raises(MappingError, match=r"consumed by no group of the mapper: \['b'\]"):
        check_safetensors({"a": meta["a"]}, tmp_path, mapper=Identity("a"))


def test_truncated_file_is_detected_before_loading(tmp_path):
    save_safetensors({"w": torch.randn(64)}, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    target = {"w": torch.zeros(64)}
    with pytest.raises(SafetensorsIOError, match=r"model.safetensors is not a readable safetensors file"):
        load_safetensors(target, tmp_path)
    assert torch.count_nonzero(target["w"]) == 0


def test_shape_mismatch_names_key_and_file_before_reading(tmp_path):
    save_safetensors({"a": torch.ones(3, 4), "b": torch.ones(2)}, tmp_path)
    target = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    with pytest.raises(
        SafetensorsIOError,
        match=r"'b' of the target has shape \(5,\).*gives \(2,\).*'b' in model.safetensors",
    ):
        load_safetensors(target, tmp_path)
    assert torch.count_nonzero(target["a"]) == 0  # nothing was loaded: it never loads half


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    save_safetensors({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path)
    with pytest.raises(MappingError, match=r"keys of the target state are produced by no group.*\['c'\]"):
        load_safetensors({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)}, tmp_path)
    with pytest.raises(MappingError, match=r"consumed by no group of the mapper: \['b'\]"):
        load_safetensors({"a": torch.zeros(2)}, tmp_path, mapper=Identity("a"))
    target = {"a": torch.zeros(2)}
    with pytest.warns(UnusedKeysWarning, match=r"\['b'\]"):
        load_safetensors(target, tmp_path, mapper=Identity("a"), unused="warn")
    assert torch.equal(target["a"], torch.ones(2))


def test_save_refuses_unconsumed_state_keys(tmp_path):
    with pytest.raises(MappingError, match=r"keys of the state to save are consumed by no group.*\['b'\]"):
        save_safetensors({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path, mapper=Identity("a"))
    assert not any(Path(tmp_path).iterdir())  # checked before anything is written


def test_scalars_and_empty_tensors_roundtrip(tmp_path):
    state = {"scale": torch.tensor(3.5), "empty": torch.zeros(0, 3), "also_empty": torch.zeros(0)}
    save_safetensors(state, tmp_path)
    target = {"scale": torch.tensor(0.0), "empty": torch.ones(0, 3), "also_empty": torch.ones(0)}
    load_safetensors(target, tmp_path)
    assert all(_bits_equal(target[k], state[k]) for k in state)
