"""Forward-only runs of a pipeline (evaluation): every microbatch through every stage, no backward.

A forward-only pass has one order whatever the training schedule: stage by stage in index order,
each rank running all microbatches of its stage before its next stage, each as it arrives from the
stage before, and sending the stage's outputs (without waiting) once all its inputs are received.
So every rank posts its transfers in one global order (by stage boundary, then microbatch), and
no two ranks can wait on each other even where their sends and receives to one peer share one
ordered stream (NCCL's point-to-point; a send posted before the receives of its stage would make a
cycle on a layout whose pair of ranks talks both ways: interleaved and V). Its outputs are the
one-process forward's whatever the stage-to-rank layout (loop or V), and it keeps nothing: no
receive buffer, no tensor saved for backward (it runs under `torch.no_grad()`). Each transfer sends
a small header first (the tensors' count, dtypes and shapes), so microbatches may have any shape,
e.g. an eval set whose last microbatch is short. (torch's `schedule.eval` reuses the training
step's buffers, sized by the first step's shapes and microbatch count.)
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from d9d.parallel.pipeline.errors import PipelineError
from d9d.parallel.pipeline.layout import PipelineLayout

__all__ = ["forward_only"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_MAX_DIMS = 6
_MAX_TENSORS = 4
_HEADER = 1 + _MAX_TENSORS * (2 + _MAX_DIMS)


def forward_only(
    layout: PipelineLayout,
    modules: Sequence[nn.Module],
    group: dist.ProcessGroup,
    inputs: Sequence[Any] | None,
    kwargs: Sequence[Mapping[str, Any]],
    device: torch.device,
) -> list[Any] | None:
    """The last stage's output of every microbatch (on the rank holding it; None elsewhere).

    Args:
        layout: the pipeline's plan (the same on every rank).
        modules: this rank's stage modules, one per `layout.stages_of_rank(rank)`, in that order.
        group: the pipeline axis's process group.
        inputs: per microbatch, the first stage's input (a tensor or a tuple of them); read only on
            the rank with the first stage.
        kwargs: per microbatch, keyword inputs given to every stage's forward.
        device: where the stages run (received tensors are made there).
    """
    rank = dist.get_rank(group)
    mine = dict(zip((s.index for s in layout.stages_of_rank(rank)), modules, strict=True))
    held: list[Any] = []  # the outputs of the stage this rank ran last
    sends: list[list[Any]] = []  # pending sends, with the tensors they read
    with torch.no_grad():
        for spec in layout.stages:
            module = mine.get(spec.index)
            if module is None:
                continue
            local_input = not spec.is_first and layout.stages[spec.index - 1].rank == rank
            to = None if spec.is_last else layout.stages[spec.index + 1].rank
            outputs = []
            for m, microbatch_kwargs in enumerate(kwargs):
                if spec.is_first:
                    args = _as_args(inputs[m] if inputs is not None else None)
                elif local_input:
                    args = _as_args(held[m])
                else:
                    args = _receive(layout.stages[spec.index - 1].rank, group, device)
                outputs.append(module(*args, **microbatch_kwargs))
            held = outputs
            if to is not None and to != rank:  # after the stage's receives: see the module docstring
                sends += [_send(out, to, group) for out in outputs]
                held = []
    for pending in sends:
        for work in pending[0]:
            work.wait()
    return held if layout.stages[-1].rank == rank else None


def _as_args(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, tuple) else (x,)


def _send(out: Any, to: int, group: dist.ProcessGroup) -> list[Any]:
    """Send `out` (a tensor or a tuple of them) to group rank `to` without waiting: [works, tensors]."""
    tensors = tuple(t.contiguous() for t in (out if isinstance(out, tuple) else (out,)))
    if len(tensors) > _MAX_TENSORS or any(t.dim() > _MAX_DIMS or t.dtype not in _DTYPES for t in tensors):
        raise PipelineError(
            f"pipeline forward-only pass: a stage output of {len(tensors)} tensor(s) "
            f"{[(t.dtype, tuple(t.shape)) for t in tensors]} cannot be sent; a stage hands over at most "
            f"{_MAX_TENSORS} tensors of at most {_MAX_DIMS} dims of dtypes {[str(d) for d in _DTYPES]}"
        )
    header = [len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]
    header += [0] * (_HEADER - len(header))
    head = torch.tensor(header, dtype=torch.int64, device=tensors[0].device)
    works = [dist.isend(t, group_dst=to, group=group) for t in (head, *tensors)]  # in order, per pair
    return [works, head, tensors]


def _receive(source: int, group: dist.ProcessGroup, device: torch.device) -> tuple[torch.Tensor, ...]:
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(head, group_src=source, group=group)
    header = head.tolist()
    tensors = []
    for i in range(header[0]):
        dtype, ndim, *dims = header[1 + i * (2 + _MAX_DIMS) : 1 + (i + 1) * (2 + _MAX_DIMS)]
        tensors.append(torch.empty(dims[:ndim], dtype=_DTYPES[dtype], device=device))
    for t in tensors:
        dist.recv(t, group_src=source, group=group)
    return tuple(tensors)
