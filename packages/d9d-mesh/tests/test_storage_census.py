"""`StorageCensus`: the storages made inside a block that are alive after it, by bytes, with no hook."""

import dataclasses

import torch

from d9d.mesh.testing import StorageCensus


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor


def test_counts_what_the_block_made_and_someone_keeps():
    outside = torch.ones(4, 4)
    census = StorageCensus()
    with census:
        kept = outside @ outside  # made here, kept: 64 bytes
        view = outside[1:].t()  # a view of a tensor made before: not made here
        dropped = outside * 2  # made here, then dropped
        out = _Output(outside.sum())  # made here, excluded below (inside a dataclass)
    del dropped
    assert census.seen == 3
    size, what = census.alive([out])
    assert size == kept.untyped_storage().nbytes() == 64 and what == ["aten.mm.default (4, 4) float32"]
    assert view.untyped_storage()._cdata == outside.untyped_storage()._cdata
    del kept
    assert census.alive([out]) == (0, [])


def test_a_graph_kept_without_backward_keeps_its_saved_tensors_alive():
    weight = torch.randn(8, 8, requires_grad=True)
    census = StorageCensus()
    with census:
        loss = (torch.randn(2, 8) @ weight).tanh().sum()  # tanh saves its output
    assert census.alive([loss])[0] > 0
    loss.backward()  # backward frees what the graph saved
    assert census.alive([loss, weight.grad]) == (0, [])
