"""`TiedParameters`: copies of one parameter on several stages start equal, sum their gradients and
count once in the gradient norm (on two pp ranks, and on two chunks of one rank)."""

import torch
import torch.distributed as dist
from torch import nn

from d9d.mesh.testing import run_distributed
from d9d.parallel import grad_norm, is_tied_copy
from d9d.parallel.pipeline import TiedParameters, declared_ties
from d9d.parallel.pipeline.tied import find_parameter


class _Stage(nn.Module):
    def __init__(self, *, embed: bool, head: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(6, 3) if embed or head else None
        self.head = nn.Linear(3, 6, bias=False) if head else None
        if head:
            self.head.weight = self.embed.weight  # type: ignore[union-attr]

    def tied_parameters(self) -> list[tuple[str, ...]]:
        return [("embed.weight", "head.weight")]


def _two_ranks() -> dict[str, object]:
    rank = dist.get_rank()
    stage = _Stage(embed=rank == 0, head=rank == 1, seed=rank)  # other values on purpose
    tied = TiedParameters([stage], [rank], dist.group.WORLD)
    (param,) = tied.local_copies(("embed.weight", "head.weight"))
    start = param.detach().clone()
    param.grad = torch.full_like(param, float(rank + 1))
    tied.sum_grads()
    return {
        "start": start,
        "grad": param.grad.clone(),
        "copy": is_tied_copy(param),
        "norm": float(grad_norm([param], pp_group=dist.group.WORLD)),
    }


def test_copies_on_two_pipeline_ranks_start_equal_sum_gradients_and_count_once_2ranks():
    first, last = run_distributed(_two_ranks, 2)
    assert torch.equal(first["start"], last["start"])  # the first stage's value
    assert torch.equal(first["grad"], torch.full((6, 3), 3.0)) and torch.equal(last["grad"], first["grad"])
    assert (first["copy"], last["copy"]) == (False, True)
    assert abs(first["norm"] - 3.0 * 18**0.5) < 1e-5 and first["norm"] == last["norm"]


def _one_rank_two_chunks() -> dict[str, object]:
    chunks = [_Stage(embed=True, head=False, seed=0), _Stage(embed=False, head=True, seed=1)]
    tied = TiedParameters(chunks, [0, 3], dist.group.WORLD)
    own, later = tied.local_copies(("embed.weight", "head.weight"))
    assert later is find_parameter(chunks[1], "head.weight") and declared_ties(chunks) == [
        ("embed.weight", "head.weight")
    ]
    equal_at_start = torch.equal(own, later)
    with torch.no_grad():
        own.add_(1.0)  # an optimizer step on the merged module's (the first chunk's) copy
    tied.copy_values()
    own.grad, later.grad = torch.ones_like(own), torch.full_like(later, 2.0)
    tied.sum_grads()
    return {"start": equal_at_start, "copied": torch.equal(own, later), "grad": own.grad, "later": later.grad}


def test_copies_on_two_chunks_of_one_rank_follow_the_first_1rank():
    (result,) = run_distributed(_one_rank_two_chunks, 1)
    assert result["start"] and result["copied"] and result["later"] is None
    assert torch.equal(result["grad"], torch.full((6, 3), 3.0))
