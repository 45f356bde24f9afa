"""`merge_stage_modules`: a rank's stage chunks as one module under the whole model's names."""

import pytest
import torch
from torch import nn

from d9d.parallel.pipeline import PipelineError, StageChunks, merge_stage_modules


class _Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)


class _Model(nn.Module):
    """Like a decoder trimmed to a stage: an optional embedding, some layers, an optional head."""

    def __init__(self, layers: list[int], *, embed: bool = False, head: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4) if embed else None
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in layers})
        self.rope = _Rope()
        self.head = nn.Linear(4, 10) if head else None


def test_chunks_merge_under_their_own_names_sharing_the_parameters():
    first, last = _Model([0], embed=True), _Model([3], head=True)  # a V-shaped rank: stages 0 and 3
    merged = merge_stage_modules([first, last])
    assert isinstance(merged, StageChunks) and merged.chunks == (first, last)
    names = dict(merged.named_parameters())
    assert sorted(names) == [
        "embed.weight", "head.bias", "head.weight", "layers.0.bias", "layers.0.weight",
        "layers.3.bias", "layers.3.weight",
    ]  # fmt: skip
    assert names["layers.3.weight"] is last.layers["3"].weight and names["embed.weight"] is first.embed.weight
    assert set(merged.state_dict()) == set(first.state_dict()) | set(last.state_dict())
    merged.eval()
    assert not first.training and not last.training
    with pytest.raises(PipelineError, match="run them through a Pipeline"):
        merged(torch.zeros(1))


def test_one_chunk_is_itself_and_overlapping_chunks_are_refused():
    only = _Model([0, 1])
    assert merge_stage_modules([only]) is only
    with pytest.raises(PipelineError, match=r"both hold 'layers\.1'"):
        merge_stage_modules([_Model([0, 1]), _Model([1, 2])])
    with pytest.raises(PipelineError, match="at least one"):
        merge_stage_modules([])


class _TiedModel(_Model):
    """A stage of a model whose head shares the embedding: the last stage keeps both (tied)."""

    def __init__(self, layers: list[int], *, embed: bool = False, head: bool = False) -> None:
        super().__init__(layers, embed=embed or head, head=head)
        if head:
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # type: ignore[union-attr]

    def tied_parameters(self) -> list[tuple[str, ...]]:
        return [("embed.weight", "head.weight")]


def test_tied_copies_of_two_chunks_merge_into_one_parameter_as_in_one_process():
    first, last = _TiedModel([0], embed=True), _TiedModel([3], head=True)  # V: stages 0 and 3
    assert last.embed is not None and last.embed.weight is not first.embed.weight  # type: ignore[union-attr]
    merged = merge_stage_modules([first, last])
    names = dict(merged.named_parameters())
    assert sorted(names) == [
        "embed.weight",
        "layers.0.bias",
        "layers.0.weight",
        "layers.3.bias",
        "layers.3.weight",
    ]
    assert names["embed.weight"] is first.embed.weight  # type: ignore[union-attr]
    state = merged.state_dict(keep_vars=True)
    assert set(state) == set(first.state_dict()) | set(last.state_dict())  # head.weight too, as one process
    assert state["head.weight"] is first.embed.weight  # type: ignore[union-attr]
    assert last.head.weight is last.embed.weight  # type: ignore[union-attr]  (the chunk itself is untouched)
    with pytest.raises(PipelineError, match=r"both hold 'embed'"):
        merge_stage_modules([first, last], tied=[])  # undeclared, the copies collide
