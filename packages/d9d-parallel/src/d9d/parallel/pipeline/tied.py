"""Parameters tied across pipeline stages (tied embeddings): one parameter of the model, a copy per stage.

In one process a tied LM head and the input embedding are one tensor. Cut into stages, the first
stage holds the table and the last stage the head, each a parameter of its own module. A stage module
declares such names with `tied_parameters() -> [("model.embed_tokens.weight", "lm_head.weight")]`
(whole-model names; a stage holds any of them); `Pipeline` then keeps the copies one parameter:

- the copies start equal: the first stage's value is sent to the others when the pipeline is built;
- after each step's backward, their gradients are summed (between the chunks of one rank, then over
  the pp ranks holding a copy), so every copy gets the one-process gradient and the same update;
- the gradient norm counts the parameter once: every copy but the first stage's is registered with
  `d9d.parallel.register_tied_copy`.

On a rank with several chunks (V schedules hold the first and the last stage on one rank) the copy of
the later chunk is no parameter of the merged module (`merge_stage_modules` shows the first chunk's
under every tied name), so the optimizer and checkpoints see one parameter; that copy takes the first
chunk's value before every step and gives its gradient to it after.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel.gradient_norm import register_tied_copy
from d9d.parallel.pipeline.errors import PipelineError

__all__ = ["TiedParameters", "declared_ties", "find_parameter"]

Tie = tuple[str, ...]


def declared_ties(modules: Sequence[nn.Module]) -> list[Tie]:
    """The ties the modules declare with `tied_parameters()`, each once, in order of declaration.

    Raises:
        PipelineError: a tie names fewer than two parameters.
    """
    ties: list[Tie] = []
    for module in modules:
        declare = getattr(module, "tied_parameters", None)
        if not callable(declare):
            continue
        for tie in declare():
            tie = tuple(tie)
            if len(set(tie)) < 2:
                raise PipelineError(f"a tie of parameters names at least two parameters, got {tie!r}")
            if tie not in ties:
                ties.append(tie)
    return ties


def find_parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter `module` holds under the dotted `name`, or None (a stage without that part)."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    return owner._parameters.get(leaf)


@dataclass
class _Tie:
    names: Tie
    copies: list[nn.Parameter]  # this rank's, by increasing stage index (the first is this rank's own)
    ranks: list[int] = field(default_factory=list)  # the pp ranks holding a copy
    shape: tuple[int, ...] = ()  # local shape and dtype of the copies (for ranks that hold none)
    dtype: torch.dtype = torch.float32


class TiedParameters:
    """The ties of this rank's stages: starts the copies equal and sums their gradients each step.

    Every rank of the pp group builds it (one object exchange), holders or not.

    Args:
        modules: this rank's stage modules.
        stage_indices: their stage indices (increasing).
        group: the pp process group.
        ties: the tied names; None reads `tied_parameters()` of the modules.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_indices: Sequence[int],
        group: dist.ProcessGroup,
        *,
        ties: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.group = group
        local_ties = declared_ties(modules) if ties is None else [tuple(t) for t in ties]
        held: dict[Tie, tuple[int, tuple[int, ...], str, str] | None] = {}
        found: dict[Tie, list[nn.Parameter]] = {}
        for tie in local_ties:
            copies: list[nn.Parameter] = []
            first_stage = None
            for index, module in zip(stage_indices, modules, strict=True):
                for name in tie:
                    param = find_parameter(module, name)
                    if param is not None and all(param is not c for c in copies):
                        copies.append(param)
                        first_stage = index if first_stage is None else first_stage
            found[tie] = copies
            if copies:
                local = _local(copies[0])
                for other in copies[1:]:
                    _check_alike(tie, copies[0], other, "two chunks of this rank")
                held[tie] = (first_stage or 0, tuple(local.shape), str(local.dtype), _spec(copies[0]))
            else:
                held[tie] = None
        size = dist.get_world_size(group)
        tables: list[Any] = [None] * size
        dist.all_gather_object(tables, held, group=group)
        self._ties: list[_Tie] = []
        for tie in dict.fromkeys(t for table in tables for t in table):
            holders = sorted(
                ((info[0], rank, info) for rank, table in enumerate(tables) if (info := table.get(tie))),
            )
            if not holders:
                continue
            specs = {info[1:] for _, _, info in holders}
            if len(specs) > 1:
                raise PipelineError(
                    f"the pipeline stages hold the tied parameters {list(tie)} with other local shapes, dtypes "
                    f"or placements ({sorted(specs)}): parallelize their modules alike (same sharding) on "
                    "every stage"
                )
            _, shape, dtype, _ = holders[0][2]
            entry = _Tie(tie, found.get(tie, []), [rank for _, rank, _ in holders], shape, _dtype(dtype))
            self._ties.append(entry)
            canonical_rank = holders[0][1]
            for index, param in enumerate(entry.copies):
                if index > 0 or dist.get_rank(group) != canonical_rank:
                    register_tied_copy(param)
        self._broadcast_values()
        self.copy_values()

    @property
    def ties(self) -> list[Tie]:
        """The ties some stage holds, in the same order on every pp rank."""
        return [t.names for t in self._ties]

    def local_copies(self, tie: Sequence[str]) -> list[nn.Parameter]:
        """This rank's copies of `tie`, the first being the one its optimizer updates."""
        return next(t.copies for t in self._ties if t.names == tuple(tie))

    @torch.no_grad()
    def copy_values(self) -> None:
        """Each later chunk's copy takes the value of this rank's first copy (no communication)."""
        for tie in self._ties:
            for other in tie.copies[1:]:
                _local(other).copy_(_local(tie.copies[0]))

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Every copy's gradient becomes the sum over all copies (of this rank's chunks, then of the
        pp ranks holding one); later chunks' copies give theirs to the first and drop it."""
        for tie in self._ties:
            first = tie.copies[0] if tie.copies else None
            for other in tie.copies[1:]:
                if other.grad is not None:
                    assert first is not None
                    if first.grad is None:
                        first.grad = other.grad.clone()
                    else:
                        _local(first.grad).add_(_local(other.grad))
                    other.grad = None
            if len(tie.ranks) < 2:
                continue
            if first is not None and first.grad is None:
                first.grad = torch.zeros_like(first)
            buffer = (
                _local(first.grad)
                if first is not None and first.grad is not None
                else torch.zeros(tie.shape, dtype=tie.dtype, device=self._device())
            )
            dist.all_reduce(buffer, group=self.group)

    @torch.no_grad()
    def _broadcast_values(self) -> None:
        """The copies on other pp ranks take the first stage's value."""
        for tie in self._ties:
            if len(tie.ranks) < 2:
                continue
            buffer = (
                _local(tie.copies[0])
                if tie.copies
                else torch.zeros(tie.shape, dtype=tie.dtype, device=self._device())
            )
            dist.broadcast(buffer, group_src=tie.ranks[0], group=self.group)

    def _device(self) -> torch.device:
        for tie in self._ties:
            if tie.copies:
                return _local(tie.copies[0]).device
        return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor (shares storage with `tensor`)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _spec(param: torch.Tensor) -> str:
    if isinstance(param, DTensor):
        return f"{tuple(param.shape)} {param.placements} over {param.device_mesh.mesh_dim_names}"
    return f"{tuple(param.shape)} plain"


def _check_alike(tie: Tie, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    la, lb = _local(a), _local(b)
    if (la.shape, la.dtype, _spec(a)) != (lb.shape, lb.dtype, _spec(b)):
        raise PipelineError(
            f"{where} hold the tied parameters {list(tie)} with other shapes, dtypes or placements "
            f"({_spec(a)} {la.dtype} vs {_spec(b)} {lb.dtype}): parallelize their modules alike"
        )


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
