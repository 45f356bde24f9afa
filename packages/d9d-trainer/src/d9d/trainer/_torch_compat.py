"""The torch calls of d9d.trainer that differ between the supported torch versions (2.11 to 2.15).

One function per difference; each docstring says which versions differ and how. Code elsewhere in
d9d.trainer calls these instead of checking versions itself.
"""

__all__ = ["dump_fr_trace"]


def dump_fr_trace(backend: str) -> bytes:
    """The flight-recorder trace (pickled; empty when recording is off) of a non-NCCL `backend`.

    torch 2.15 keeps one recorder per backend and takes its name: `_dump_fr_trace(..., backend=)`.
    Earlier versions (2.11 to 2.13 checked) have no `backend` argument (a TypeError) and one recorder, the
    one gloo records into: that is gloo's trace, and other backends have none.
    """
    import torch._C._distributed_c10d as c10d_ext

    try:
        return c10d_ext._dump_fr_trace(includeStackTraces=False, backend=backend)
    except TypeError:
        return c10d_ext._dump_fr_trace(includeStackTraces=False) if backend == "gloo" else b""
