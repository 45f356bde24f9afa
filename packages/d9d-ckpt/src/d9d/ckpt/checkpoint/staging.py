"""Host staging of asynchronous saves: one copy into host buffers that later saves reuse.

An asynchronous save first copies the state off the training tensors (the training loop may change
them right after `save` returns); only that copy stalls the loop. torch.distributed.checkpoint's
default allocates fresh, pageable host memory for every save. `HostStaging` keeps one
`DefaultStager` for the manager's lifetime instead: its buffers are allocated on the first save and
refilled in place by every later one, and when the state lives on CUDA they are pinned and filled by
non-blocking copies, so the stall is one device-to-host copy at full bandwidth. On a CPU-only machine
nothing is pinned (pinning needs CUDA); the buffers are still reused.

The cost: one host copy of the rank's state (pinned, on CUDA) stays allocated until `close()`.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from d9d.ckpt._torch_compat import reusable_stager

__all__ = ["HostStaging", "state_on_cuda"]


def state_on_cuda(state: Any) -> bool:
    """Whether any tensor of a (nested) state dict lives on a CUDA device (a DTensor: its local part)."""
    return any(t.device.type == "cuda" for t in _tensors(state))


class HostStaging:
    """The stager an asynchronous save passes to `dcp.async_save`, or None for DCP's default.

    Args:
        reuse: keep the host buffers between saves (pinned when the state is on CUDA); False gives
            DCP's default, a fresh pageable copy per save that is freed once it is written.
    """

    def __init__(self, reuse: bool = True) -> None:
        self._reuse = reuse
        self._stager: DefaultStager | None = None
        self._pinned = False

    @property
    def pinned(self) -> bool:
        """True once the buffers are pinned host memory (a CUDA state, reused buffers)."""
        return self._pinned

    def stager(self, state: Mapping[str, Any]) -> AsyncStager | None:
        """The stager for a save of `state` (created on the first save; the same one afterwards).

        The caller must have waited for the previous save's write: the buffers are overwritten.
        """
        if not self._reuse:
            return None
        if self._stager is None:
            pin = torch.cuda.is_available() and state_on_cuda(state)
            options = StagingOptions(
                use_pinned_memory=pin,
                use_shared_memory=False,  # the writer is a thread of this process
                use_async_staging=False,  # the copy completes before `save` returns: then training may go on
                use_non_blocking_copy=pin,  # many copies queued, one synchronize
            )
            self._stager = reusable_stager(options)
            self._pinned = pin
        return self._stager

    def close(self) -> None:
        """Free the host buffers (and unpin them)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
            self._pinned = False


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
