"""Random-number-generator state of Python, numpy and torch as plain data (no pickle).

`capture_rng_state()` returns a dict of bytes, ints, floats and lists that the checkpoint's extra
state can hold; `restore_rng_state(state)` puts every generator back where it was.
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
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators captured by `capture_rng_state` (CUDA only where both have CUDA)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = np.frombuffer(npy["keys"], dtype=np.uint32).copy()
    np.random.set_state((npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_byte_tensor(s) for s in state["cuda"]])


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
