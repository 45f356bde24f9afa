"""Leaf transforms: what each one does, and map-then-inverse is the identity where invertible."""

import pytest
import torch

from d9d.ckpt import (
    Cast,
    Chunk,
    Concat,
    Deduplicate,
    Drop,
    Duplicate,
    Identity,
    MappingError,
    NotInvertibleError,
    Rename,
    Reshape,
    RopePermute,
    Stack,
    StateMapper,
    Transpose,
    Unstack,
    apply_mapper,
    rename_pattern,
)


def _roundtrip(mapper: StateMapper, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mapped = apply_mapper(mapper, state)
    back = apply_mapper(mapper.inverse(), mapped)
    assert back.keys() == state.keys()
    for key, tensor in state.items():
        assert back[key].dtype == tensor.dtype
        assert torch.equal(back[key], tensor), key
    return mapped


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def test_identity_and_rename_roundtrip():
    x = _randn(3, 2)
    assert apply_mapper(Identity("a"), {"a": x})["a"] is x
    mapped = _roundtrip(Rename("a", "b"), {"a": x})
    assert set(mapped) == {"b"} and mapped["b"] is x


def test_rename_pattern_carries_layer_indices_and_inverts():
    keys = [f"layers.{i}.attn.wq.weight" for i in range(3)]
    state = {k: _randn(2, i + 2) for i, k in enumerate(keys)}
    mapper = rename_pattern(
        r"layers\.(\d+)\.attn\.wq\.weight", r"model.layers.\1.self_attn.q_proj.weight", keys
    )
    mapped = _roundtrip(mapper, state)
    for i, key in enumerate(keys):
        assert mapped[f"model.layers.{i}.self_attn.q_proj.weight"] is state[key]


def test_rename_pattern_that_matches_nothing_names_the_pattern():
    with pytest.raises(MappingError, match=r"matched none of 2 keys.*'a.weight'"):
        rename_pattern(r"layers\.(\d+)", "x", ["a.weight", "b.weight"])


def test_transpose_roundtrip():
    x = _randn(3, 5)
    mapped = _roundtrip(Transpose("w", output="w_t"), {"w": x})
    assert torch.equal(mapped["w_t"], x.T)


def test_transpose_of_a_vector_is_an_error_naming_the_key():
    with pytest.raises(MappingError, match=r"'bias'.*at least 2 dims"):
        apply_mapper(Transpose("bias"), {"bias": _randn(3)})


def test_reshape_roundtrip_with_source_shape_and_not_without():
    x = _randn(4, 6)
    mapped = _roundtrip(Reshape("w", (2, 2, 6), source_shape=(4, 6)), {"w": x})
    assert torch.equal(mapped["w"].flatten(), x.flatten())
    with pytest.raises(NotInvertibleError, match="source_shape"):
        Reshape("w", (24,)).inverse()
    with pytest.raises(MappingError, match=r"expected shape \(4, 6\)"):
        apply_mapper(Reshape("w", (24,), source_shape=(4, 6)), {"w": _randn(6, 4).T.contiguous()[:3]})


@pytest.mark.parametrize("dim", [0, 1])
def test_stack_unstack_roundtrip(dim):
    experts = {f"experts.{i}.w": _randn(3, 4) + i for i in range(4)}
    mapped = _roundtrip(Stack(list(experts), "grouped", dim=dim), experts)
    assert mapped["grouped"].shape[dim] == 4
    for i in range(4):
        assert torch.equal(mapped["grouped"].select(dim, i), experts[f"experts.{i}.w"])
    _roundtrip(Unstack("grouped", list(experts), dim=dim), mapped)


def test_unstack_count_mismatch_and_stack_shape_mismatch():
    with pytest.raises(MappingError, match=r"'g' has shape \(3, 2\).*4 entries"):
        apply_mapper(Unstack("g", ["a", "b", "c", "d"]), {"g": _randn(3, 2)})
    with pytest.raises(MappingError, match="different shapes"):
        apply_mapper(Stack(["a", "b"], "g"), {"a": _randn(2), "b": _randn(3)})


def test_chunk_concat_roundtrip_equal_parts():
    qkv = _randn(12, 5)
    mapped = _roundtrip(Chunk("qkv", ["q", "k", "v"]), {"qkv": qkv})
    assert torch.equal(torch.cat([mapped["q"], mapped["k"], mapped["v"]]), qkv)
    _roundtrip(Concat(["gate", "up"], "gate_up", dim=0), {"gate": _randn(3, 2), "up": _randn(3, 2) + 1})


def test_chunk_concat_roundtrip_grouped_query_sizes():
    sizes = (8, 4, 4)  # 4 query heads, 2 kv heads of 2 rows each
    qkv = _randn(16, 3)
    mapped = _roundtrip(Chunk("qkv", ["q", "k", "v"], sizes=sizes), {"qkv": qkv})
    assert [mapped[k].shape[0] for k in "qkv"] == list(sizes)
    assert torch.equal(mapped["k"], qkv[8:12])


def test_chunk_and_concat_size_errors():
    with pytest.raises(MappingError, match="10 entries along dim 0, not divisible into 3"):
        apply_mapper(Chunk("qkv", ["q", "k", "v"]), {"qkv": _randn(10, 2)})
    with pytest.raises(MappingError, match="sum to 9"):
        apply_mapper(Chunk("qkv", ["q", "k"], sizes=(4, 5)), {"qkv": _randn(10, 2)})
    with pytest.raises(MappingError, match="pass sizes="):
        apply_mapper(Concat(["q", "k"], "qk"), {"q": _randn(4, 2), "k": _randn(2, 2)})


@pytest.mark.parametrize("shape", [(16, 3), (16,)])
def test_rope_permute_pairs_rows_as_documented(shape):
    head_dim = 4
    x = _randn(*shape)
    half = apply_mapper(RopePermute("q", head_dim, to="half"), {"q": x})["q"]
    for head in range(shape[0] // head_dim):
        base = head * head_dim
        for i in range(head_dim // 2):  # interleaved pair (2i, 2i+1) becomes (i, i + head_dim/2)
            assert torch.equal(half[base + i], x[base + 2 * i])
            assert torch.equal(half[base + i + head_dim // 2], x[base + 2 * i + 1])
    _roundtrip(RopePermute("q", head_dim, to="half"), {"q": x})
    _roundtrip(RopePermute("q", head_dim, to="interleaved"), {"q": x})


def test_rope_permute_rejects_bad_head_dim():
    with pytest.raises(MappingError, match="positive even"):
        RopePermute("q", 3)
    with pytest.raises(MappingError, match="not a multiple of head_dim=4"):
        apply_mapper(RopePermute("q", 4), {"q": _randn(6, 2)})


def test_cast_roundtrip_when_widening_and_not_invertible_without_source_dtype():
    x = _randn(5).to(torch.bfloat16)
    mapped = _roundtrip(Cast("w", torch.float32, source_dtype=torch.bfloat16), {"w": x})
    assert mapped["w"].dtype == torch.float32
    with pytest.raises(NotInvertibleError, match="source_dtype"):
        Cast("w", torch.float32).inverse()


def test_drop_consumes_and_is_not_invertible():
    assert apply_mapper(Drop(["rope.cache", "mask"]), {"rope.cache": _randn(2), "mask": _randn(2)}) == {}
    with pytest.raises(NotInvertibleError, match="Drop"):
        Drop(["x"]).inverse()
    with pytest.raises(MappingError, match="at least one key"):
        Drop([])


def test_duplicate_deduplicate_roundtrip_for_tied_weights():
    w = _randn(4, 3)
    mapped = _roundtrip(
        Deduplicate(["embed.weight", "head.weight"], "embed_tokens"), {"embed.weight": w, "head.weight": w}
    )
    assert list(mapped) == ["embed_tokens"]
    out = _roundtrip(Duplicate("embed_tokens", ["embed.weight", "head.weight"]), mapped)
    assert out["head.weight"] is out["embed.weight"]


def test_deduplicate_refuses_tensors_that_differ():
    with pytest.raises(MappingError, match=r"'b' differs from 'a', so they are not tied"):
        apply_mapper(Deduplicate(["a", "b"], "ab"), {"a": torch.zeros(2), "b": torch.ones(2)})
