"""The Hugging Face safetensors layout: file names, the index file, shard sizes and shard planning."""

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from d9d.ckpt.io._errors import SafetensorsIOError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "index_document",
    "is_layout_file",
    "parse_size",
    "plan_shards",
    "read_layout",
    "shard_file_name",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "500MB", "5GB" or "2GiB" (decimal and binary units)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, re.IGNORECASE)
        if not match:
            raise SafetensorsIOError(f"shard size {size!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value <= 0:
        raise SafetensorsIOError(f"shard size must be positive, got {size!r}")
    return value


def shard_file_name(index: int, count: int) -> str:
    """`model-0000i-of-0000N.safetensors` for 1-based `index`, or `model.safetensors` when `count` is 1."""
    return SINGLE_FILE if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def is_layout_file(name: str) -> bool:
    """Whether a file name belongs to this layout (and may be replaced by a new export)."""
    return name in (SINGLE_FILE, INDEX_FILE) or bool(_SHARD_RE.fullmatch(name))


def plan_shards(sizes: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Split items (in order, with byte sizes) into consecutive shards of at most `max_bytes` each.

    An item larger than `max_bytes` gets a shard of its own; an empty list gives one empty shard.
    """
    shards: list[list[int]] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(index)
        used += size
    return shards


def index_document(weight_map: Mapping[str, str], total_size: int) -> dict[str, Any]:
    """The content of `model.safetensors.index.json`."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def read_layout(directory: Path) -> dict[str, str]:
    """Key → file name of a folder in this layout (index file, else a single `model.safetensors`).

    The folder must hold exactly the files its index names: a missing shard, and a file of this
    layout the index does not name (a shard of another export, a `model.safetensors` beside an
    index), are refused, since either means the folder mixes or lacks weights.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SafetensorsIOError(
                f"{index} is not a valid index file (needs a 'weight_map' object): {exc}"
            ) from exc
        if not isinstance(weight_map, dict):
            raise SafetensorsIOError(f"{index}: 'weight_map' must map tensor names to file names")
        named = {str(name) for name in weight_map.values()}
        for name in sorted(named):
            if not (directory / name).is_file():
                raise SafetensorsIOError(
                    f"{index} names {name!r}, which is not in {directory}; the folder is incomplete: "
                    "copy that shard back (or download the model again)"
                )
        unnamed = sorted(
            path.name
            for path in directory.iterdir()
            if path.name != INDEX_FILE and is_layout_file(path.name) and path.name not in named
        )
        if unnamed:
            raise SafetensorsIOError(
                f"{directory / unnamed[0]} is not named by {index}: the folder mixes the files of two "
                "exports (or downloads); remove the files the index does not name, or restore the index "
                "that names them"
            )
        return {str(k): str(v) for k, v in weight_map.items()}
    shards = sorted(
        path.name for path in directory.glob("model-*.safetensors") if _SHARD_RE.fullmatch(path.name)
    )
    if shards:
        raise SafetensorsIOError(
            f"{directory} holds shards ({shards[0]}, ...) but no {INDEX_FILE}, so which tensors they hold "
            "is unknown; restore the index file (or download the model again)"
        )
    if (directory / SINGLE_FILE).is_file():
        return {}  # filled from the file's header by the reader
    raise SafetensorsIOError(
        f"{directory} holds neither {INDEX_FILE} nor {SINGLE_FILE}; point to a Hugging Face model folder"
    )
