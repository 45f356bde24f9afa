"""Shared helpers of the writer and the reader: the state of a module, ranks, meta stand-ins."""

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._check import OnUnused, check_mapper
from d9d.ckpt.mapper._rename import identity_map

__all__ = ["as_state", "is_writer", "mapped_groups", "meta_like", "resolve_mapper"]


def as_state(source: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a module (its tensors share memory with the module), or the mapping itself."""
    return dict(source.state_dict()) if isinstance(source, nn.Module) else dict(source)


def is_writer() -> bool:
    """Global rank 0 writes files; without a process group, the one process does."""
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def meta_like(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A storage-free tensor of the full shape, to dry-run a mapper before any data is touched."""
    return torch.empty(shape, dtype=dtype, device="meta")


def resolve_mapper(mapper: StateMapper | None, keys: list[str]) -> StateMapper:
    """The given mapper, or identity over `keys`."""
    return identity_map(keys) if mapper is None else mapper


def mapped_groups(
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], mapper: StateMapper | None, unused: OnUnused
) -> tuple[StateMapper, list[MappingGroup], list[dict[str, torch.Tensor]]]:
    """The mapper checked against every rank's keys, its groups that give something (in order), and
    each group's outputs as meta tensors (a dry run: their names, shapes and dtypes, no data)."""
    mapper = resolve_mapper(mapper, list(layout))
    check_mapper(mapper, layout.keys(), unused=unused, source="the state to save")
    groups = [g for g in mapper.groups() if g.outputs]  # a group that gives nothing needs no gather
    outputs = [mapper.apply({k: meta_like(*layout[k]) for k in group.inputs}) for group in groups]
    return mapper, groups, outputs
