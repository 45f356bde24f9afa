"""The torch calls of d9d.ckpt that differ between the supported torch versions (2.11 to 2.15).

One function per difference; each docstring says which versions differ and how. Code elsewhere in
d9d.ckpt calls these instead of checking versions itself.
"""

from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

__all__ = ["reusable_stager"]


def reusable_stager(options: StagingOptions) -> DefaultStager:
    """A `DefaultStager` that keeps its host buffers from one save to the next, until `close()`.

    torch 2.13 and later keep them. 2.11 and 2.12 empty the stager's copy table and its cached
    buffers at the end of every stage (to break a reference cycle), so a second save through the
    same stager fails (`KeyError: <class 'type'>`); there the stager returned defers that cleanup
    to its own `close()`.
    """
    if torch.__version__ >= "2.13":
        return DefaultStager(options)
    return _KeepingStager(options)


class _KeepingStager(DefaultStager):
    """torch 2.11/2.12: the per-stage cleanup of the copy table is skipped; `close()` still frees."""

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        copier = self._state_dict_stager
        copier.close = _keep  # type: ignore[method-assign]  # what torch calls after copying
        try:
            return super()._stage(state_dict, **kwargs)
        finally:
            del copier.close  # the class's close again, for DefaultStager.close()


def _keep() -> None:
    return None
