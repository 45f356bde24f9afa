"""Checking a mapper against the keys of a state before any tensor is read, and applying it in memory."""

import warnings
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from d9d.ckpt.mapper._base import StateMapper
from d9d.ckpt.mapper._errors import MappingError, UnusedKeysWarning, format_keys

__all__ = ["OnUnused", "apply_mapper", "check_mapper"]

OnUnused = Literal["error", "warn", "ignore"]


def check_mapper(
    mapper: StateMapper, keys: Iterable[str], *, unused: OnUnused = "error", source: str = "the state"
) -> None:
    """Check that `keys` hold every input of `mapper`, and that the mapper consumes every key.

    Args:
        keys: the keys of the state the mapper will read.
        unused: what to do about keys no group consumes: raise (default), warn, or ignore.
        source: how to name the state in messages (a folder, "the model's state dict", ...).

    Raises:
        MappingError: listing the missing keys, or the unconsumed keys when `unused="error"`.
    """
    available = frozenset(keys)
    if missing := mapper.inputs - available:
        raise MappingError(
            f"{len(missing)} keys that the mapper reads are missing from {source}: {format_keys(missing)}; "
            "fix the mapper's input names or the state"
        )
    extra = available - mapper.inputs
    if not extra or unused == "ignore":
        return
    message = (
        f"{len(extra)} keys of {source} are consumed by no group of the mapper: {format_keys(extra)}; "
        "map them, Drop(...) them, or pass unused='warn'"
    )
    if unused == "error":
        raise MappingError(message)
    warnings.warn(message, UnusedKeysWarning, stacklevel=2)


def apply_mapper(
    mapper: StateMapper, state: Mapping[str, torch.Tensor], *, unused: OnUnused = "error"
) -> dict[str, torch.Tensor]:
    """Map a whole in-memory state at once (checked first); for files, use the streaming IO instead."""
    check_mapper(mapper, state.keys(), unused=unused)
    out: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        out.update(mapper.apply({k: state[k] for k in group.inputs}))
    return out


def _check_targets(mapper: StateMapper, targets: Iterable[str], source: str) -> None:
    """Every target key is produced and every output has a target."""
    targets = frozenset(targets)
    if missing := targets - mapper.outputs:
        raise MappingError(
            f"{len(missing)} keys of {source} are produced by no group of the mapper: {format_keys(missing)}"
        )
    if extra := mapper.outputs - targets:
        raise MappingError(
            f"the mapper produces {len(extra)} keys that {source} does not have: {format_keys(extra)}"
        )
