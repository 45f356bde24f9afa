"""Host-to-device defaults: pinned batches when the job runs on CUDA, and non-blocking copies."""

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import torch

__all__ = ["pin_memory_enabled", "to_device"]

T = TypeVar("T")


def pin_memory_enabled(setting: bool | Literal["auto"], device: torch.device | None) -> bool:
    """Whether batches should come in pinned host memory.

    "auto" pins when the batches are for a CUDA device; True pins whenever CUDA is usable; False never.
    Pinning needs a usable CUDA runtime, so without one it is always off.
    """
    if setting is False or not torch.cuda.is_available():
        return False
    if setting == "auto":
        return device is not None and device.type == "cuda"
    return True


def to_device(batch: T, device: torch.device | str) -> T:
    """`batch` with every tensor (in nested dicts, lists and tuples) moved to `device`, non-blocking.

    From pinned memory the copy to CUDA is asynchronous: the host goes on while the copy runs, and
    kernels on the current stream that use the result wait for it. Tensors already there are returned
    as they are; other values are left alone.
    """
    return _move(batch, torch.device(device))


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return type(value)({k: _move(v, device) for k, v in value.items()})
    if isinstance(value, Mapping):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_move(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device) for v in value)
    return value
