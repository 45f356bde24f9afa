"""Encoding of the caller's small extra state (step, data state, scheduler, RNG, config) as msgpack.

Plain data only, no pickle: dicts with string keys, lists, tuples (read back as lists), str, int,
float, bool, None, bytes, and msgspec structs (read back as dicts).
"""

from collections.abc import Mapping
from typing import Any

import msgspec

from d9d.ckpt.checkpoint.errors import CheckpointError

__all__ = ["decode_state", "encode_state"]


def encode_state(state: Mapping[str, Any], what: str) -> bytes:
    """Encode `state` to msgpack bytes.

    Raises:
        CheckpointError: naming the key path of the first value that is not plain data.
    """
    try:
        return msgspec.msgpack.encode(dict(state))
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        path = _first_unencodable(state, what) or what
        raise CheckpointError(
            f"{path} cannot be stored in a checkpoint ({exc}); extra state must be plain data "
            "(dict, list, str, int, float, bool, None, bytes); convert tensors and arrays first "
            "(e.g. `tensor.tolist()`, `capture_rng_state()`)"
        ) from None


def decode_state(data: bytes, where: str) -> dict[str, Any]:
    """Decode msgpack bytes written by `encode_state`.

    Raises:
        CheckpointError: naming `where` when the bytes are not a valid encoded state.
    """
    try:
        value = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{where} is corrupt ({exc}); the checkpoint cannot be loaded") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} is corrupt (holds a {type(value).__name__}, not a dict)")
    return value


def _first_unencodable(value: Any, path: str) -> str | None:
    """Key path of the first leaf that msgpack cannot encode (for the error message)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _first_unencodable(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _first_unencodable(item, f"{path}[{index}]")
            if found:
                return found
        return None
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError):
        return f"{path} ({type(value).__name__})"
    return None
