"""`AutoDataProvider`: a fixed global batch per step, split over data-parallel ranks into microbatches.

Order and epochs. Epoch `e` visits the dataset in a seeded permutation (or in index order when
`shuffle` is off) that depends only on (seed, e) and the dataset length, never on the mesh; it is
computed per position (`d9d.data.order`), so no rank ever holds a permutation of the dataset. Each step
consumes the next `global_batch_size` positions of that order; data-parallel rank `r` of `dp` loads
the contiguous slice `[r·gbs/dp, (r+1)·gbs/dp)` of them and cuts it into microbatches. An epoch ends
when the next step cannot start: with `drop_last` when fewer than a global batch of positions are
left (they are skipped; with shuffling, different samples each epoch), without `drop_last` when every
position was consumed (the last step is filled up from the start of the same epoch's order).

A dataset that orders itself (`OrdersItself`, a `MixtureDataset`) is read as one stream instead:
each step takes the next `global_batch_size` stream indices (epoch e, position p is stream index
e·len + p; no shuffling, no samples skipped or refilled at an epoch's end), the dataset's
`stream_state` goes into the data state, and the stream may end (`steps_left`).
"""

from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from d9d.data.batching import (
    advance_position,
    check_batch_sizes,
    check_dataset_size,
    is_step_start,
    rank_slice,
    step_sample_indices,
    steps_per_epoch,
)
from d9d.data.config import AutoDataConfig
from d9d.data.device import pin_memory_enabled
from d9d.data.errors import DatasetError, DataStateError
from d9d.data.loader import MicrobatchIndices, make_loader
from d9d.data.order import EpochOrder, epoch_order
from d9d.data.placement import DataPlacement, PipelineStages, pipeline_ranks
from d9d.data.protocol import DeclaresSources, OrdersItself
from d9d.mesh import DistributedContext

__all__ = ["AutoDataProvider", "MapDataset"]

BatchT = TypeVar("BatchT")
SampleT_co = TypeVar("SampleT_co", covariant=True)

# 2: the order is the Feistel bijection of d9d.data.order; 1 was a materialized numpy permutation.
_STATE_VERSION = 2
_ORDER_KEYS = ("num_samples", "seed", "shuffle")


class MapDataset(Protocol[SampleT_co]):
    """What `AutoDataProvider` needs from a dataset: a length and samples by index."""

    def __len__(self) -> int:
        """Number of samples."""
        ...

    def __getitem__(self, index: int) -> SampleT_co:
        """The sample at `index` (0 <= index < len)."""
        ...


class AutoDataProvider(Generic[BatchT]):
    """Batches a map-style dataset for data-parallel training with a fixed global batch.

    Every step yields this rank's `global_batch_size / (dp × microbatch_size)` microbatches, each the
    collated list of `microbatch_size` samples. Iterating never ends: after the last step of an epoch
    comes the first step of the next one. Use `len(provider)` (steps per epoch) to stop after epochs.

        provider = AutoDataProvider(AutoDataConfig(global_batch_size=32, microbatch_size=4), dataset,
                                    context=ctx)
        for step, microbatches in zip(range(total_steps), provider):
            ...

    Args:
        config: batch sizes, shuffling, seed, drop_last and loader settings.
        dataset: any map-style dataset (`len` and integer indexing); read only by ranks that load.
        collate_fn: turns a list of samples into a batch (default: torch's `default_collate`).
        context: where this rank sits: a `DistributedContext`, a `DataPlacement`, or None for one
            local process. The data-parallel degree is `dp_replicate × dp_shard`. A context whose
            device is CUDA also turns on pinned batches under the default `pin_memory="auto"`.
        pipeline_stages: under pipeline parallelism, the pipeline ranks whose stages consume data
            ("first", "last", "first_and_last", "all" or a collection of pp coordinates). Other
            pipeline ranks load nothing and get an empty list per step, but keep the same state.
        device: the device the batches are for, when `context` is not a `DistributedContext` (whose
            device is used otherwise); it only decides `pin_memory="auto"`. Batches stay on the host.

    Raises:
        BatchSizeError: global_batch_size is not divisible by dp × microbatch_size.
        DatasetError: the dataset holds fewer samples than one global batch.
    """

    def __init__(
        self,
        config: AutoDataConfig,
        dataset: MapDataset[Any],
        collate_fn: Callable[[list[Any]], BatchT] | None = None,
        *,
        context: DistributedContext | DataPlacement | None = None,
        pipeline_stages: PipelineStages = "all",
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(context, DistributedContext):
            placement = DataPlacement.from_context(context)
            device = context.device if device is None else device
        else:
            placement = context if context is not None else DataPlacement()
        check_batch_sizes(config.global_batch_size, config.microbatch_size, placement.dp_size)
        self._config = config
        self._dataset = dataset
        self._collate_fn: Callable[[list[Any]], BatchT] = collate_fn or default_collate
        self._placement = placement
        self._num_samples = len(dataset)
        check_dataset_size(self._num_samples, config.global_batch_size)
        self._loads_data = placement.pp_rank in pipeline_ranks(pipeline_stages, placement.pp_size)
        self._microbatches = config.global_batch_size // (placement.dp_size * config.microbatch_size)
        self._rank_slice = rank_slice(config.global_batch_size, placement.dp_size, placement.dp_rank)
        self._device = torch.device(device) if device is not None else None
        self._pin_memory = pin_memory_enabled(config.pin_memory, self._device)
        self._epoch = 0
        self._position = 0
        self._stream = dataset if isinstance(dataset, OrdersItself) else None
        self._index = 0  # the next step's first stream index (a dataset that orders itself)
        #: What `load_state_dict` found changed in a self-ordering dataset (e.g. mixture weights), a
        #: line each, for the caller to log.
        self.resume_changes: list[str] = []
        if self._stream is not None:
            self._check_stream_holds_a_step()
        self._batches: Iterator[BatchT] | None = None
        # Samples each named source gave so far (a mixture): counted from the global batch's indices.
        self._sources = list(dataset.source_names) if isinstance(dataset, DeclaresSources) else None
        self._source_samples = np.zeros(len(self._sources or ()), dtype=np.int64)
        self._retired: dict[str, int] = {}  # sources of the saved run no longer mixed: their counts

    # ------------------------------------------------------------------ what this rank gets

    @property
    def config(self) -> AutoDataConfig:
        """The batching configuration."""
        return self._config

    @property
    def placement(self) -> DataPlacement:
        """This rank's data-parallel and pipeline coordinates."""
        return self._placement

    @property
    def loads_data(self) -> bool:
        """False on pipeline ranks whose stages consume no data (they get empty steps)."""
        return self._loads_data

    @property
    def microbatches_per_step(self) -> int:
        """Microbatches each data-parallel rank runs per step: global_batch_size / (dp × microbatch_size)."""
        return self._microbatches

    @property
    def device(self) -> torch.device | None:
        """The device the batches are for (the context's), or None when not known."""
        return self._device

    @property
    def pin_memory(self) -> bool:
        """Whether batches come in pinned host memory (resolved from `config.pin_memory`)."""
        return self._pin_memory

    @property
    def num_samples(self) -> int:
        """Length of the dataset."""
        return self._num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one full epoch (floor of samples / global batch with drop_last, else ceil)."""
        return steps_per_epoch(self._num_samples, self._config.global_batch_size, self._config.drop_last)

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def epoch(self) -> int:
        """Epoch of the next step."""
        return self._index // self._num_samples if self._stream is not None else self._epoch

    @property
    def position(self) -> int:
        """Position, in that epoch's sample order, where the next step starts."""
        return self._index % self._num_samples if self._stream is not None else self._position

    @property
    def shuffle(self) -> bool:
        """Whether the order is shuffled: `config.shuffle`, except for a dataset that orders itself."""
        return self._config.shuffle and self._stream is None

    @property
    def steps_left(self) -> int | None:
        """Steps the data still holds from the next one on: None (endless) unless a dataset that
        orders itself ends (a mixture with `exhausted: stop`)."""
        end = self._stream.stream_end if self._stream is not None else None
        if end is None:
            return None
        return max(0, (end - self._index) // self._config.global_batch_size)

    def order(self, epoch: int) -> EpochOrder:
        """The global sample order of epoch `epoch` (the same on every rank and every mesh)."""
        return epoch_order(self._num_samples, seed=self._config.seed, epoch=epoch, shuffle=self.shuffle)

    def sample_indices(self, epoch: int, position: int) -> np.ndarray:
        """Dataset indices this rank loads for the step that starts at (epoch, position)."""
        lo, hi = self._rank_slice
        if self._stream is not None:
            return epoch * self._num_samples + position + np.arange(lo, hi, dtype=np.int64)
        return step_sample_indices(self.order(epoch), position, lo, hi)

    def _check_stream_holds_a_step(self) -> None:
        left = self.steps_left
        if left == 0:
            raise DatasetError(
                f"the dataset ends (a mixture with exhausted: stop, at stream index {self._stream.stream_end}) "  # type: ignore[union-attr]
                f"before a step of {self._config.global_batch_size} samples from stream index {self._index}; "
                "use exhausted: repeat, add data or lower data.global_batch_size"
            )

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> "AutoDataProvider[BatchT]":
        return self

    def __next__(self) -> list[BatchT]:
        """This rank's microbatches of the next step (an empty list on ranks that load no data)."""
        step: list[BatchT] = []
        if self.steps_left == 0:
            raise StopIteration
        if self._loads_data:
            if self._batches is None:
                self._batches = iter(self._make_loader())
            step = [next(self._batches) for _ in range(self._microbatches)]
        gbs = self._config.global_batch_size
        if self._sources is not None:  # the whole global batch, the same on every rank: no communication
            if self._stream is not None:
                batch = self._index + np.arange(gbs, dtype=np.int64)
            else:
                batch = step_sample_indices(self.order(self._epoch), self._position, 0, gbs)
            sources = np.asarray(self._dataset.source_of(batch), dtype=np.int64)  # type: ignore[attr-defined]
            self._source_samples += np.bincount(sources, minlength=len(self._sources))
        if self._stream is not None:
            self._index += gbs
            return step
        self._epoch, self._position = advance_position(
            self._epoch,
            self._position,
            num_samples=self._num_samples,
            global_batch_size=self._config.global_batch_size,
            drop_last=self._config.drop_last,
        )
        return step

    def _make_loader(self) -> DataLoader[Any]:
        stream = self._stream
        indices = MicrobatchIndices(
            self._config,
            self._num_samples,
            self._rank_slice,
            epoch=self.epoch,
            position=self.position,
            shuffle=self.shuffle,
            streamed=stream is not None,
            stream_end=None if stream is None else stream.stream_end,
        )
        return make_loader(self._dataset, indices, self._collate_fn, pin_memory=self._pin_memory)

    def close(self) -> None:
        """Stop loader workers and drop prefetched batches; iteration may continue afterwards."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self) -> "AutoDataProvider[BatchT]":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def source_tokens(self) -> dict[str, int] | None:
        """Tokens each source of a mixture (`DeclaresSources`) gave over the run's steps so far
        (samples × the dataset's `seq_len`; samples when it has none); None for other datasets.
        Kept in `state_dict`, so it counts from the run's first step across resumes (a source mixed no
        longer keeps its count)."""
        if self._sources is None:
            return None
        seq_len = getattr(self._dataset, "seq_len", None)
        scale = seq_len if isinstance(seq_len, int) else 1
        return {name: n * scale for name, n in self._source_counts().items()}

    def _source_counts(self) -> dict[str, int]:
        assert self._sources is not None
        return {**self._retired, **dict(zip(self._sources, self._source_samples.tolist(), strict=True))}

    # ------------------------------------------------------------------ resumable state

    def state_dict(self) -> dict[str, Any]:
        """Where the next step starts, plus what defines the order (checked on load)."""
        stream = self._stream
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self._num_samples,
            "seed": self._config.seed,
            "shuffle": self.shuffle,
            "global_batch_size": self._config.global_batch_size,
            "drop_last": self._config.drop_last,
            **({"source_samples": self._source_counts()} if self._sources is not None else {}),
            **(
                {"stream_index": self._index, "stream": stream.stream_state(self._index)}
                if stream is not None
                else {}
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next step the one after the saved position; works across DP degrees.

        The dataset length, seed and shuffle must match the saved run (they define the order).
        The global batch size may change: the next step then starts at the saved sample position.
        A dataset that orders itself continues its stream at the saved index through its
        `resume_stream` (a mixture may change its weights there); what it reports changed is left in
        `resume_changes`.

        Raises:
            DataStateError: keys are missing, the state has another version (version 1: the old
                materialized permutation), or the order would differ from the saved run's.
        """
        missing = [k for k in ("version", "epoch", "position", *_ORDER_KEYS) if k not in state]
        if missing:
            raise DataStateError(
                f"the data state lacks {missing} (it has {sorted(state)}); pass the dict that "
                "AutoDataProvider.state_dict() returned"
            )
        _check_version(state["version"])
        if self._stream is not None:
            self._load_stream_state(state)
            return
        if "stream_index" in state:
            raise DataStateError(
                "the saved data state is a mixture's stream, but this dataset is not a mixture; restore the "
                "saved run's dataset section, or start a new run"
            )
        ours = self.state_dict()
        changed = [f"{k}: saved {state[k]!r}, now {ours[k]!r}" for k in _ORDER_KEYS if state[k] != ours[k]]
        if changed:
            raise DataStateError(
                "the saved data state belongs to another sample order (" + "; ".join(changed) + "), so "
                "resuming would not continue the same sequence of batches; restore the dataset and "
                "data.seed/data.shuffle of the saved run, or start a new run"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._num_samples:
            raise DataStateError(
                f"the saved data state has epoch {epoch} and position {position}, outside a dataset "
                f"of {self._num_samples} samples; the checkpoint's data state is corrupt"
            )
        config = self._config
        if not is_step_start(position, self._num_samples, config.global_batch_size, config.drop_last):
            epoch, position = epoch + 1, 0
        self.close()
        self._epoch, self._position = epoch, position
        self._load_source_counts(state)

    def _load_source_counts(self, state: Mapping[str, Any]) -> None:
        if self._sources is None:
            return
        saved = {str(n): int(c) for n, c in (state.get("source_samples") or {}).items()}
        # A source the saved run did not have starts at 0; one it had that is gone keeps its count.
        self._source_samples = np.asarray([saved.get(n, 0) for n in self._sources], dtype=np.int64)
        self._retired = {n: c for n, c in saved.items() if n not in self._sources}

    def _load_stream_state(self, state: Mapping[str, Any]) -> None:
        assert self._stream is not None
        if "stream_index" not in state or not isinstance(state.get("stream"), Mapping):
            raise DataStateError(
                "the saved data state is not a mixture's stream, but this dataset is a mixture; restore the "
                "saved run's dataset section, or start a new run"
            )
        index = state["stream_index"]
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise DataStateError(
                f"the saved stream index {index!r} is not an index; the data state is corrupt"
            )
        self.close()
        self.resume_changes = self._stream.resume_stream(index, state["stream"])
        self._index = index
        self._load_source_counts(state)


def _check_version(version: object) -> None:
    if version == _STATE_VERSION:
        return
    if version == 1:
        raise DataStateError(
            "the saved data state has version 1, whose sample order was a full numpy permutation per "
            f"epoch; this d9d-data (data state version {_STATE_VERSION}) computes the order with a seeded "
            "Feistel bijection, so resuming would not continue the same sequence of batches; start a new "
            "run (another trainer.run.name or save_dir), or finish this one with the d9d-data that wrote it"
        )
    raise DataStateError(
        f"the saved data state has version {version!r}, but this d9d-data reads version {_STATE_VERSION}; "
        "resume with the d9d-data version that wrote the checkpoint"
    )
