"""Compose transforms: parallel collisions, sequential group merging, prefix scope, inverses."""

import pytest
import torch

from d9d.ckpt import (
    Chunk,
    Drop,
    Identity,
    MappingError,
    MappingGroup,
    Parallel,
    Prefix,
    Rename,
    RopePermute,
    Sequential,
    Stack,
    Transpose,
    apply_mapper,
    identity_map,
)


def _state(*keys: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(8, 4, generator=gen) for k in keys}


def test_parallel_groups_are_the_union_and_apply_dispatches():
    mapper = Parallel([Rename("a", "x"), Transpose("b"), Stack(["c", "d"], "cd")])
    assert set(mapper.groups()) == {
        MappingGroup(frozenset({"a"}), frozenset({"x"})),
        MappingGroup(frozenset({"b"}), frozenset({"b"})),
        MappingGroup(frozenset({"c", "d"}), frozenset({"cd"})),
    }
    state = _state("a", "b", "c", "d")
    out = apply_mapper(mapper, state)
    assert torch.equal(out["b"], state["b"].T) and out["cd"].shape == (2, 8, 4)


def test_parallel_rejects_colliding_inputs_listing_keys():
    with pytest.raises(
        MappingError, match=r"input keys \['a'\] are read by more than one mapper.*Rename\('a' -> 'x'\)"
    ):
        Parallel([Rename("a", "x"), Rename("a", "y")])


def test_parallel_rejects_colliding_outputs_listing_keys():
    with pytest.raises(MappingError, match=r"output keys \['x', 'y'\] are written by more than one"):
        Parallel([Parallel([Rename("a", "x"), Rename("b", "y")]), Rename("c", "x"), Rename("d", "y")])


def test_sequential_merges_groups_of_connected_stages():
    # two fused tensors chunked, then a transform that mixes one part of each: one merged group
    mapper = Sequential(
        [
            Parallel([Chunk("ab", ["a", "b"]), Chunk("cd", ["c", "d"]), Identity("e")]),
            Parallel([Stack(["a", "c"], "ac"), Identity("b"), Identity("d"), Identity("e")]),
        ]
    )
    groups = {g.inputs: g.outputs for g in mapper.groups()}
    assert groups == {
        frozenset({"ab", "cd"}): frozenset({"ac", "b", "d"}),
        frozenset({"e"}): frozenset({"e"}),
    }
    state = _state("ab", "cd", "e")
    out = apply_mapper(mapper, state)
    assert torch.equal(out["ac"][1], state["cd"][:4]) and torch.equal(out["d"], state["cd"][4:])


def test_sequential_fused_qkv_with_rope_roundtrip():
    mapper = Sequential(
        [Chunk("qkv", ["q", "k", "v"]), Parallel([RopePermute("q", 4), RopePermute("k", 4), Identity("v")])]
    )
    state = {"qkv": torch.randn(24, 3)}
    back = apply_mapper(mapper.inverse(), apply_mapper(mapper, state))
    assert torch.equal(back["qkv"], state["qkv"])


def test_sequential_reports_missing_and_unread_intermediate_keys():
    with pytest.raises(MappingError, match=r"stage 1 .* reads \['z'\], which stage 0 .* does not produce"):
        Sequential([Rename("a", "x"), Parallel([Identity("x"), Identity("z")])])
    with pytest.raises(
        MappingError, match=r"outputs \['y'\] of stage 0 .* read by no group of stage 1.*Identity"
    ):
        Sequential([Parallel([Rename("a", "x"), Rename("b", "y")]), Transpose("x")])


def test_sequential_keeps_drop_groups_and_direct_sources_compose():
    mapper = Sequential([Parallel([Rename("a", "b"), Drop(["junk"])]), Rename("b", "c")])
    assert {g.inputs: g.outputs for g in mapper.groups()} == {
        frozenset({"a"}): frozenset({"c"}),
        frozenset({"junk"}): frozenset(),
    }
    assert mapper.direct_sources() == {"c": "a"}
    assert Sequential([Rename("a", "b"), Transpose("b")]).direct_sources() == {}


def test_prefix_scopes_a_block_mapper_per_layer_and_inverts():
    block = Parallel([Rename("attn.wq.weight", "self_attn.q_proj.weight"), Transpose("mlp.w")])
    mapper = Parallel([Prefix(f"layers.{i}.", block, output_prefix=f"model.layers.{i}.") for i in range(2)])
    state = _state(*(f"layers.{i}.{k}" for i in range(2) for k in ("attn.wq.weight", "mlp.w")))
    out = apply_mapper(mapper, state)
    assert set(out) == {
        f"model.layers.{i}.{k}" for i in range(2) for k in ("self_attn.q_proj.weight", "mlp.w")
    }
    assert torch.equal(out["model.layers.1.mlp.w"], state["layers.1.mlp.w"].T)
    assert mapper.direct_sources()["model.layers.0.self_attn.q_proj.weight"] == "layers.0.attn.wq.weight"
    back = apply_mapper(mapper.inverse(), out)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_apply_with_keys_of_no_group_is_an_error():
    mapper = Parallel([Stack(["a", "b"], "ab"), Identity("c")])
    with pytest.raises(
        MappingError, match=r"got keys \['a'\], which are not the inputs of one of its groups"
    ):
        mapper.apply(_state("a"))


def test_identity_map_keeps_everything():
    state = _state("a", "b")
    assert apply_mapper(identity_map(state), state) == state


def test_select_outputs_writes_only_the_selected_keys_and_loads_part_of_a_model(tmp_path):
    from d9d.ckpt import Duplicate, SelectOutputs, load_safetensors, save_safetensors

    applied: list[str] = []

    class Counted(Rename):  # not a direct source: the loader reads its input and applies it
        def _apply(self, group, tensors):
            applied.append(self.source)
            return super()._apply(group, tensors)

        def direct_sources(self):
            return {}

    whole = Parallel([Counted("a", "x"), Duplicate("e", ["e1", "e2"]), Counted("c", "y")])
    stage = SelectOutputs(whole, {"x", "e1"})
    assert set(stage.groups()) == {
        MappingGroup(frozenset({"a"}), frozenset({"x"})),
        MappingGroup(frozenset({"e"}), frozenset({"e1"})),
        MappingGroup(frozenset({"c"}), frozenset()),
    }
    assert stage.inputs == whole.inputs and stage.outputs == {"x", "e1"}
    assert stage.direct_sources() == {"e1": "e"}

    folder = tmp_path / "whole"
    source = _state("a", "c", "e")
    save_safetensors(source, folder)
    target = {"x": torch.zeros(8, 4), "e1": torch.zeros(8, 4)}
    load_safetensors(target, folder, mapper=stage)
    assert torch.equal(target["x"], source["a"]) and torch.equal(target["e1"], source["e"])
    assert "a" in applied and "c" not in applied  # a group no selected key needs is not applied
    with pytest.raises(MappingError, match="'e2'"):  # a target key the selection leaves out
        load_safetensors({**target, "e2": torch.zeros(8, 4)}, folder, mapper=stage)
    save_safetensors({**source, "stray": torch.zeros(1)}, tmp_path / "stray")
    with pytest.raises(MappingError, match="stray"):  # the folder is still checked whole
        load_safetensors(target, tmp_path / "stray", mapper=stage)
