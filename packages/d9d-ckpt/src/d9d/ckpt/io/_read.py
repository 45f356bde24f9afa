"""Streaming import of a Hugging Face safetensors folder into a model, DTensor parameters included."""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.ckpt.io._errors import SafetensorsIOError
from d9d.ckpt.io._layout import DTYPES, SINGLE_FILE, read_layout
from d9d.ckpt.io._placement import dtensor_local_slices, has_local_slice, local_part_of_full
from d9d.ckpt.io._state import as_state, meta_like, resolve_mapper
from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._check import OnUnused, _check_targets, check_mapper
from d9d.ckpt.mapper._errors import MappingError, format_keys

__all__ = ["check_safetensors", "load_safetensors", "safetensors_shapes"]

#: File name → key → (shape, dtype) of a folder, from its headers.
_Headers = dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]


def load_safetensors(
    target: nn.Module | Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    mapper: StateMapper | None = None,
    unused: OnUnused = "error",
) -> None:
    """Fill `target` in place from a safetensors folder in the HF layout, through `mapper`.

    Everything is checked from the file headers before any tensor is read: the mapper's inputs exist
    in the folder, every file key is consumed (`unused`), the mapper produces exactly the target's
    keys, with the target's shapes. Then files are read one at a time. A tensor that the mapper only
    renames is read straight into its parameter; for a DTensor only the local shard's slice is read
    (`Shard`/`Replicate` placements; other shardings are read in full and split locally). Other
    groups are read in full, mapped, and each rank copies its part. Values are cast to the target's dtype. Every rank of a distributed job calls it; no
    collectives are used.

    Args:
        target: a module (its `state_dict()` tensors are written in place) or a mapping of tensors.
        directory: folder with `model.safetensors.index.json` + shards, or `model.safetensors`.
        mapper: maps file keys to target keys (e.g. `export_mapper.inverse()`); identity when None.
        unused: what to do about file keys the mapper does not consume.

    Raises:
        SafetensorsIOError: naming the folder, file and key when the folder does not fit the target.
        MappingError: when the mapper does not fit the folder or the target (the keys are listed).
    """
    folder = Path(directory)
    state = as_state(target)
    headers, mapper = _checked(folder, state, mapper, unused)
    groups = mapper.groups()
    direct = mapper.direct_sources()
    group_of = {key: g for g in groups for key in g.inputs}
    pending: dict[frozenset[str], dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for name in sorted(headers):
            path = folder / name
            with safe_open(path, framework="pt") as handle:
                for key in sorted(headers[name]):
                    group = group_of.get(key)
                    if group is None or not group.outputs:
                        continue
                    if all(out in direct for out in group.outputs):
                        for out in group.outputs:
                            if direct[out] == key:
                                _place_direct(handle, key, state[out], path)
                        continue
                    parts = pending.setdefault(group.inputs, {})
                    parts[key] = handle.get_tensor(key)
                    if len(parts) == len(group.inputs):
                        _place_group(mapper, group, pending.pop(group.inputs), state)
    if pending:  # the header check makes this unreachable unless files change while being read
        missing = {k for parts in pending.values() for k in parts}
        raise SafetensorsIOError(
            f"{folder}: groups left incomplete after reading every file: {format_keys(missing)}"
        )


def check_safetensors(
    target: nn.Module | Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    mapper: StateMapper | None = None,
    unused: OnUnused = "error",
) -> None:
    """Everything `load_safetensors` checks before it reads a tensor, reading none: the layout (every
    file the index names and no other), the keys both ways and every shape after mapping.

    `target` may be on the meta device, so a job can refuse a folder before it allocates the model or
    writes anything; the same checks run again when it loads.

    Raises:
        SafetensorsIOError: naming the folder, file and key when the folder does not fit the target.
        MappingError: when the mapper does not fit the folder or the target (the keys are listed).
    """
    _checked(Path(directory), as_state(target), mapper, unused)


def safetensors_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a safetensors folder (HF layout) and its shape, from the file headers (no data read).

    Raises:
        SafetensorsIOError: the folder is not in the layout, or a header is unreadable.
    """
    headers = _read_headers(Path(directory))
    return {key: shape for specs in headers.values() for key, (shape, _) in sorted(specs.items())}


def _checked(
    folder: Path, state: Mapping[str, torch.Tensor], mapper: StateMapper | None, unused: OnUnused
) -> tuple[_Headers, StateMapper]:
    """The folder's headers and the resolved mapper, once every check of `check_safetensors` passed."""
    headers = _read_headers(folder)
    file_of = {key: name for name, specs in headers.items() for key in specs}
    mapper = resolve_mapper(mapper, list(file_of))
    check_mapper(mapper, file_of, unused=unused, source=f"the safetensors folder {folder}")
    _check_targets(mapper, state, "the target state")
    specs = {key: spec for file_specs in headers.values() for key, spec in file_specs.items()}
    for group in mapper.groups():  # shapes, before any data is read
        out = mapper.apply({k: meta_like(*specs[k]) for k in group.inputs})
        for key, tensor in out.items():
            if tuple(tensor.shape) != tuple(state[key].shape):
                sources = ", ".join(f"{k!r} in {file_of[k]}" for k in sorted(group.inputs))
                raise SafetensorsIOError(
                    f"key {key!r} of the target has shape {tuple(state[key].shape)}, but {folder} gives "
                    f"{tuple(tensor.shape)} (from {sources}); the folder was written for another model config"
                )
    return headers, mapper


def _read_headers(folder: Path) -> _Headers:
    """File name → key → (shape, dtype), from the headers only; checked against the index."""
    weight_map = read_layout(folder)
    names = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    headers: _Headers = {}
    for name in names:
        path = folder / name
        try:
            with safe_open(path, framework="pt") as handle:
                specs = {}
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    view = handle.get_slice(key)
                    dtype = DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise SafetensorsIOError(
                            f"{path}: key {key!r} has dtype {view.get_dtype()}, not supported"
                        )
                    specs[key] = (tuple(view.get_shape()), dtype)
        except SafetensorsIOError:
            raise
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise SafetensorsIOError(
                f"{path} is not a readable safetensors file (truncated or corrupt?): {exc}"
            ) from exc
        headers[name] = specs
    for key, name in weight_map.items():
        if key not in headers[name]:
            raise SafetensorsIOError(
                f"{folder}: the index puts {key!r} in {name}, but that file does not hold it"
            )
    seen: dict[str, str] = {}
    for name, specs in headers.items():
        for key in specs:
            if key in seen:
                raise SafetensorsIOError(f"{folder}: key {key!r} is in both {seen[key]} and {name}")
            if weight_map and weight_map.get(key) != name:
                raise SafetensorsIOError(
                    f"{folder / name} holds {key!r}, which the index does not list there"
                )
            seen[key] = name
    return headers


def _place_direct(handle: Any, key: str, dst: torch.Tensor, path: Path) -> None:
    """Copy a file tensor into `dst`, reading only the local slice when `dst` is a DTensor."""
    try:
        if isinstance(dst, DTensor) and has_local_slice(dst.placements):
            local = dst.to_local()
            slices = dtensor_local_slices(dst)
            data = handle.get_slice(key)[slices] if slices else handle.get_tensor(key)
            local.copy_(data.reshape(local.shape))
        else:
            _copy_full(handle.get_tensor(key), dst)
    except SafetensorsIOError as exc:
        raise SafetensorsIOError(f"{path}: key {key!r}: {exc}") from exc


def _place_group(
    mapper: StateMapper,
    group: MappingGroup,
    inputs: dict[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
) -> None:
    """Map one complete group and copy each output (or this rank's slice of it) into the target."""
    try:
        outputs = mapper.apply(inputs)
    except MappingError as exc:
        raise MappingError(f"while loading {format_keys(group.inputs)}: {exc}") from exc
    for key, full in outputs.items():
        _copy_full(full, state[key])


def _copy_full(full: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy a full tensor into `dst`, or this rank's part of it when `dst` is a DTensor."""
    if isinstance(dst, DTensor):
        dst.to_local().copy_(local_part_of_full(full, dst))
    else:
        dst.copy_(full)
