"""Pure batch arithmetic: microbatch counts, rank slices and which positions of the global order a step takes.

The global order is defined without reference to the mesh. Epoch `e` visits the samples in
`epoch_order(n, seed=seed, epoch=e)` (`d9d.data.order`: computed per position, never stored); a step
starting at position `p` of that order consumes the positions `[p, p + global_batch_size)`, and
data-parallel rank `r` of `dp` takes the contiguous slice `rank_slice(global_batch_size, dp, r)` of
them. So changing the DP degree changes who loads a sample, never which samples form a global batch.
"""

import math

import numpy as np

from d9d.data.errors import BatchSizeError, DataConfigError, DatasetError
from d9d.data.order import EpochOrder

__all__ = [
    "advance_position",
    "batch_size_choices",
    "check_batch_sizes",
    "check_dataset_size",
    "is_step_start",
    "microbatches_per_rank",
    "rank_slice",
    "step_sample_indices",
    "steps_per_epoch",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_size_choices(global_batch_size: int, microbatch_size: int, dp_size: int) -> dict[str, list[int]]:
    """Values that would make the batch sizes divisible, each changing one of the three numbers.

    Returns:
        {"global_batch_size": the nearest multiples of dp × microbatch_size,
         "microbatch_size": microbatch sizes that work with this global batch and dp,
         "data_parallel": DP degrees that work with this global batch and microbatch size}.
    """
    unit = dp_size * microbatch_size
    below = (global_batch_size // unit) * unit
    near = sorted({m for m in (below, below + unit, below + 2 * unit) if m > 0})[:2]
    micro = _divisors(global_batch_size // dp_size) if global_batch_size % dp_size == 0 else []
    dps = _divisors(global_batch_size // microbatch_size) if global_batch_size % microbatch_size == 0 else []
    return {"global_batch_size": near, "microbatch_size": micro, "data_parallel": dps}


def check_batch_sizes(global_batch_size: int, microbatch_size: int, dp_size: int) -> None:
    """Raise one `BatchSizeError` naming all three numbers unless dp × microbatch_size divides the batch."""
    if min(global_batch_size, microbatch_size, dp_size) < 1:
        raise BatchSizeError(
            f"batch sizes must be >= 1, got data.global_batch_size={global_batch_size}, "
            f"data.microbatch_size={microbatch_size}, data-parallel ranks={dp_size}"
        )
    unit = dp_size * microbatch_size
    if global_batch_size % unit == 0:
        return
    choices = batch_size_choices(global_batch_size, microbatch_size, dp_size)
    options = [f"data.global_batch_size to a multiple of {unit} (e.g. {choices['global_batch_size']})"]
    if choices["microbatch_size"]:
        options.append(f"data.microbatch_size to one of {choices['microbatch_size']}")
    if choices["data_parallel"]:
        options.append(
            "the data-parallel degree (mesh.data_parallel_replicate × mesh.data_parallel_shard) "
            f"to one of {choices['data_parallel']}"
        )
    raise BatchSizeError(
        f"data.global_batch_size={global_batch_size} is not divisible by data-parallel ranks ({dp_size}) × "
        f"data.microbatch_size ({microbatch_size}) = {unit}, so the ranks cannot get equal whole "
        f"microbatches; change " + ", or ".join(options)
    )


def microbatches_per_rank(global_batch_size: int, microbatch_size: int, dp_size: int) -> int:
    """Microbatches each data-parallel rank runs per step: global_batch_size / (dp × microbatch_size)."""
    check_batch_sizes(global_batch_size, microbatch_size, dp_size)
    return global_batch_size // (dp_size * microbatch_size)


def rank_slice(global_batch_size: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """The half-open range of positions within a global batch that DP rank `dp_rank` loads."""
    if global_batch_size % dp_size != 0:
        raise BatchSizeError(f"global batch of {global_batch_size} cannot be split over {dp_size} ranks")
    if not 0 <= dp_rank < dp_size:
        raise DataConfigError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    per_rank = global_batch_size // dp_size
    return dp_rank * per_rank, (dp_rank + 1) * per_rank


def steps_per_epoch(num_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """Steps in one epoch started at position 0: floor (drop_last) or ceil of samples / global batch."""
    check_dataset_size(num_samples, global_batch_size)
    if drop_last:
        return num_samples // global_batch_size
    return math.ceil(num_samples / global_batch_size)


def check_dataset_size(num_samples: int, global_batch_size: int) -> None:
    """Raise `DatasetError` if the dataset cannot fill even one global batch."""
    if num_samples < global_batch_size:
        raise DatasetError(
            f"the dataset has {num_samples} samples, fewer than one global batch "
            f"(data.global_batch_size={global_batch_size}); lower data.global_batch_size to at most "
            f"{num_samples} or use a larger dataset (for token datasets: more text or a shorter sequence length)"
        )


def is_step_start(position: int, num_samples: int, global_batch_size: int, drop_last: bool) -> bool:
    """Whether a step may start at `position` of an epoch's order (else the epoch is over)."""
    if drop_last:
        return position + global_batch_size <= num_samples
    return position < num_samples


def advance_position(
    epoch: int, position: int, *, num_samples: int, global_batch_size: int, drop_last: bool
) -> tuple[int, int]:
    """The (epoch, position) where the next step starts, moving to (epoch + 1, 0) past an epoch's end.

    `position` may be any starting point (e.g. one saved with another global batch size); if no step
    can start there, the result is the start of the next epoch.
    """
    if not is_step_start(position, num_samples, global_batch_size, drop_last):
        return epoch + 1, 0
    position += global_batch_size
    if not is_step_start(position, num_samples, global_batch_size, drop_last):
        return epoch + 1, 0
    return epoch, position


def step_sample_indices(order: EpochOrder | np.ndarray, position: int, start: int, stop: int) -> np.ndarray:
    """Dataset indices at positions [position + start, position + stop) of an epoch's order.

    Positions past the end wrap to the start of the same order: that is how a last, partial step of
    an epoch is filled when drop_last is False. `order` is an `EpochOrder` (computed for these
    positions only, in one vectorized call) or any array of indices.
    """
    positions = (position + np.arange(start, stop, dtype=np.int64)) % len(order)
    if isinstance(order, EpochOrder):
        return order.indices(positions)
    return np.asarray(order)[positions]
