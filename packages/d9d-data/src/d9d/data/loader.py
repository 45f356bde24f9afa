"""The torch `DataLoader` of one data-parallel rank: its microbatch index lists from where a step
starts, and a loader seed that follows that position and the rank's slice rather than the restarts."""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from d9d.data.batching import advance_position, step_sample_indices
from d9d.data.config import AutoDataConfig
from d9d.data.order import epoch_order

__all__ = ["MicrobatchIndices", "make_loader"]


@dataclass(frozen=True)
class MicrobatchIndices:
    """The endless stream of one rank's microbatch index lists, from a given (epoch, position).

    Attributes:
        rank_slice: the rank's [lo, hi) slice of each global batch.
        streamed: the dataset orders itself: its indices are one stream, read up to `stream_end`
            when it has one.
    """

    config: AutoDataConfig
    num_samples: int
    rank_slice: tuple[int, int]
    epoch: int
    position: int
    shuffle: bool
    streamed: bool = False
    stream_end: int | None = None

    def __iter__(self) -> Iterator[Sequence[int]]:
        config = self.config
        epoch, position = self.epoch, self.position
        lo, hi = self.rank_slice
        mbs = config.microbatch_size
        if self.streamed:  # one stream of indices, to its end if it has one
            index, gbs, end = epoch * self.num_samples + position, config.global_batch_size, self.stream_end
            while end is None or index + gbs <= end:
                indices = list(range(index + lo, index + hi))
                for start in range(0, hi - lo, mbs):
                    yield indices[start : start + mbs]
                index += gbs
            return
        order = epoch_order(self.num_samples, seed=config.seed, epoch=epoch, shuffle=self.shuffle)
        while True:
            if order.epoch != epoch:
                order = epoch_order(self.num_samples, seed=config.seed, epoch=epoch, shuffle=self.shuffle)
            indices = step_sample_indices(order, position, lo, hi).tolist()
            for start in range(0, hi - lo, mbs):
                yield indices[start : start + mbs]
            epoch, position = advance_position(
                epoch,
                position,
                num_samples=self.num_samples,
                global_batch_size=config.global_batch_size,
                drop_last=config.drop_last,
            )


def make_loader(
    dataset: Any, indices: MicrobatchIndices, collate_fn: Callable[[list[Any]], Any], *, pin_memory: bool
) -> DataLoader[Any]:
    """A loader of `dataset` at `indices`, collated, in `config.num_workers` worker processes."""
    config = indices.config
    workers = config.num_workers
    return DataLoader(
        dataset,
        batch_sampler=indices,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=pin_memory,
        prefetch_factor=config.prefetch if workers > 0 else None,
        worker_init_fn=_init_worker if workers > 0 else None,
        # Its own generator: a loader draws a base seed when an iterator starts, which from the
        # global one would move the training randomness (dropout) by where the iterator started
        # (a resumed run starts it after restoring the RNG state, the first run before step 1).
        # Seeded by where it starts, so workers' seeds follow the data position, not the restarts, and
        # by the rank's slice: data-parallel ranks' workers draw differently, ranks sharing data alike.
        generator=torch.Generator().manual_seed(
            _loader_seed(config.seed, indices.epoch, indices.position, indices.rank_slice[0])
        ),
    )


def _loader_seed(seed: int, epoch: int, position: int, first: int) -> int:
    """The loader's base seed from (seed, epoch, position, the rank's first position in a global batch)."""
    return (((seed * 1_000_003 + epoch) * 1_000_003 + position) * 1_000_003 + first) % (2**63)


def _init_worker(_worker_id: int) -> None:
    # Loader workers share the machine with the training process: one thread each.
    torch.set_num_threads(1)
