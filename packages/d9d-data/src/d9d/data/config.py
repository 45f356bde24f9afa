"""`AutoDataConfig`: the `data:` section of a job, read by `AutoDataProvider`."""

from typing import Literal

import msgspec

from d9d.data.errors import DataConfigError

__all__ = ["AutoDataConfig"]


class AutoDataConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How `AutoDataProvider` batches a map-style dataset.

    Attributes:
        global_batch_size: samples per optimizer step over all data-parallel ranks. It stays fixed
            when data-parallel ranks are added; each rank then gets fewer microbatches.
        microbatch_size: samples per forward/backward pass on one rank.
        shuffle: visit the samples in a seeded random order, a new one each epoch.
        seed: seed of the per-epoch permutation (the order does not depend on the mesh).
        drop_last: True skips the `len(dataset) % global_batch_size` samples left at the end of
            each epoch's order; False fills the last step of an epoch with the first samples of the
            same epoch's order, so every sample is seen at least once per epoch.
        num_workers: worker processes that load and collate microbatches (0: in this process).
        pin_memory: return batches in pinned host memory, so copies to the GPU can be non-blocking.
            "auto" (default): when the provider's context device is CUDA; true: whenever CUDA is
            usable; false: never.
        prefetch: microbatches each worker loads ahead (used only when num_workers > 0).
    """

    global_batch_size: int
    microbatch_size: int = 1
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True
    num_workers: int = 0
    pin_memory: bool | Literal["auto"] = "auto"
    prefetch: int = 2

    def __post_init__(self) -> None:
        for key, minimum in (
            ("global_batch_size", 1),
            ("microbatch_size", 1),
            ("num_workers", 0),
            ("prefetch", 1),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise DataConfigError(f"data.{key} must be an integer >= {minimum}, got {value!r}")
        if self.pin_memory not in (True, False, "auto"):
            raise DataConfigError(f"data.pin_memory must be true, false or 'auto', got {self.pin_memory!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DataConfigError(f"data.seed must be an integer >= 0, got {self.seed!r}")
