"""Random-number-generator state of Python, numpy and torch as plain data (no pickle).

`capture_rng_state()` returns a dict of bytes, ints, floats and lists that the checkpoint's extra
state can hold; `restore_rng_state(state)` puts every generator back where it was.

CUDA: only the current device's generator (the one this process draws from) is kept, under
`cuda_device`, so a run resumes on any number of visible GPUs per process. Checkpoints written
before kept every visible device's generator as a list under `cuda`; restoring one sets the current
device from its entry, as the old code did (and skips the other entries, which could name devices
this process no longer sees).
"""

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> dict[str, Any]:
    """The state of Python's `random`, numpy's global generator, torch's CPU (and CUDA) generators."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    name, keys, pos, has_gauss, cached_gaussian = np_state
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": str(name),
            "keys": np.asarray(keys, dtype=np.uint32).tobytes(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_device"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by `capture_rng_state` (CUDA only where both have CUDA: the
    current device's generator)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = np.frombuffer(npy["keys"], dtype=np.uint32).copy()
    np.random.set_state((npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(_byte_tensor(state["cuda_device"]))
    elif "cuda" in state:  # older checkpoints: every device the saving process saw, by index
        current = torch.cuda.current_device()
        if current < len(state["cuda"]):
            torch.cuda.set_rng_state(_byte_tensor(state["cuda"][current]))


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
