"""Streaming export of a (possibly sharded) state to the Hugging Face safetensors layout."""

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from d9d.ckpt.io._gather import WriterGather
from d9d.ckpt.io._layout import (
    INDEX_FILE,
    index_document,
    is_layout_file,
    parse_size,
    plan_shards,
    shard_file_name,
)
from d9d.ckpt.io._state import as_state, barrier, is_writer, mapped_groups
from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._check import OnUnused

__all__ = ["save_safetensors"]

DEFAULT_SHARD_SIZE = "5GB"


def save_safetensors(
    source: nn.Module | Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    mapper: StateMapper | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    unused: OnUnused = "error",
    metadata: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Write a model's state (through `mapper`, e.g. into HF names) as safetensors in the HF layout.

    Every rank calls it with its own part of the model: its shards of DTensors (FSDP, TP, EP, ...)
    and, on a pipeline-parallel mesh, only its stages' keys (under the whole model's names). The
    ranks first report what they hold to rank 0 (shapes, dtypes, blocks: no data), so every rank
    plans the same files. Then, one group of the mapper at a time in file order, every piece of
    each input tensor is sent to rank 0 alone, from the one rank chosen to send it (the other ranks
    never hold a full tensor), rank 0 maps the group; a file is written as soon as its shard is
    complete, so rank 0's memory stays near one shard plus one group. The files are byte-identical
    to those one process writes from the whole model. Output is `model.safetensors` when
    everything fits in `max_shard_size`, else `model-0000i-of-0000N.safetensors` plus
    `model.safetensors.index.json`. Files of that layout already in `directory` are replaced.

    Args:
        source: a module (its `state_dict()`) or a mapping of names to tensors or DTensors.
        mapper: maps source keys to file keys; identity when None. The same mapper on every rank,
            over the keys of all ranks together (a pipeline stage's mapper covers the other stages
            too).
        max_shard_size: bytes per file (int, or "5GB", "500MB", "2GiB").
        unused: what to do about source keys the mapper does not consume.
        metadata: extra string metadata stored in every file header (besides {"format": "pt"}).

    Returns:
        The weight map (file key → file name), the same on every rank.

    Raises:
        SafetensorsIOError: ranks hold one key with other shapes or dtypes.
        MappingError: the mapper does not fit the keys of all ranks together.
    """
    gather = WriterGather(as_state(source))  # every rank's keys, shapes and dtypes, in one order
    plan = _plan_files(gather.layout, mapper, max_shard_size, unused)
    writer = is_writer()
    target = Path(directory)
    file_mode = _prepare_directory(target) if writer else 0
    header = {"format": "pt", **(metadata or {})}
    for name, shard in zip(plan.names, plan.shards, strict=True):
        _write_file(gather, plan, shard, target / name, header, file_mode, writer)
    if writer and len(plan.shards) > 1:
        document = json.dumps(index_document(plan.weight_map, sum(plan.group_sizes)), indent=2) + "\n"
        (target / INDEX_FILE).write_text(document)
    barrier()
    return plan.weight_map


@dataclass(frozen=True)
class _FilePlan:
    """Which groups of the mapper go into which file: the same on every rank.

    Attributes:
        groups: the mapper's groups that write something, in file order.
        group_sizes: the bytes of each group's outputs.
        shards: per file, the indices of its groups.
        names: per file, its name.
        weight_map: file key → file name.
    """

    mapper: StateMapper
    groups: list[MappingGroup]
    group_sizes: list[int]
    shards: list[list[int]]
    names: list[str]
    weight_map: dict[str, str]


def _plan_files(
    layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    mapper: StateMapper | None,
    max_shard_size: int | str,
    unused: OnUnused,
) -> _FilePlan:
    """Check the mapper against every rank's keys and split its groups into files of `max_shard_size`."""
    mapper, groups, outputs = mapped_groups(layout, mapper, unused)
    group_sizes = [sum(t.numel() * t.element_size() for t in out.values()) for out in outputs]
    shards = plan_shards(group_sizes, parse_size(max_shard_size))
    names = [shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    weight_map = {
        key: names[s] for s, shard in enumerate(shards) for gi in shard for key in groups[gi].outputs
    }
    return _FilePlan(mapper, groups, group_sizes, shards, names, weight_map)


def _prepare_directory(target: Path) -> int:
    """Create `target`, remove the files of an earlier export there; the mode new files get."""
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():
        if is_layout_file(old.name):
            old.unlink()
    return _new_file_mode(target)


def _write_file(
    gather: WriterGather,
    plan: _FilePlan,
    shard: list[int],
    path: Path,
    header: dict[str, str],
    file_mode: int,
    writer: bool,
) -> None:
    """Gather and map the groups of one file (every rank), and write it (the writer alone)."""
    tensors: dict[str, torch.Tensor] = {}
    for gi in shard:
        group = plan.groups[gi]
        inputs = {k: gather.full(k) for k in sorted(group.inputs)}
        if writer:
            tensors.update(plan.mapper.apply(inputs))
        del inputs  # the next group's gather must not hold this one's full tensors too
    if writer:
        safetensors.torch.save_file(_owning(tensors), path, metadata=header)
        os.chmod(path, file_mode)  # safetensors writes through a private (0o600) temp file


def _new_file_mode(directory: Path) -> int:
    """The permission bits a file created in `directory` gets (0o666 less the umask and default ACL).

    Found by creating one rather than by reading the umask: `os.umask` can only be read by setting
    it, which would race with files created meanwhile by other threads.
    """
    probe = directory / f".d9d-mode-probe-{os.getpid()}"
    probe.unlink(missing_ok=True)  # a leftover of a crash keeps its own mode
    probe.touch()
    try:
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink()


def _owning(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that each own exactly their storage (safetensors rejects shared memory)."""
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        exact = tensor.is_contiguous() and storage.nbytes() == tensor.numel() * tensor.element_size()
        if not exact or storage.data_ptr() in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out
