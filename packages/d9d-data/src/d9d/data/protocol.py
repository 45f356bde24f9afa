"""`DataProvider`: the small protocol every data provider (built-in or custom) implements; and
what a dataset may declare about its samples (`DeclaresSeqLen`, `DeclaresVocabSize`)."""

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "DataProvider",
    "DeclaresDocumentMasking",
    "DeclaresSeqLen",
    "DeclaresSources",
    "DeclaresStepsLeft",
    "DeclaresVocabSize",
    "OrdersItself",
    "ReportsSources",
    "SizedDataProvider",
]

BatchT_co = TypeVar("BatchT_co", covariant=True)


@runtime_checkable
class DataProvider(Protocol[BatchT_co]):
    """Yields, per optimizer step, this rank's microbatches, and saves/restores its position.

    Iterating gives one list per step (the microbatches this rank runs in that step, in order); the
    trainer calls `next()` once per step, so the stream may be endless. `state_dict()` describes the
    position after the steps yielded so far (not what was prefetched), and `load_state_dict()` makes
    the next step the one that followed the save. A custom provider decides its own batching.
    """

    def __iter__(self) -> Iterator[list[BatchT_co]]:
        """The stream of steps, each a list of microbatches."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """A small dict of plain values (ints, floats, strings, bools) that a checkpoint stores."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a state returned by `state_dict()`, possibly saved by another run."""
        ...


@runtime_checkable
class SizedDataProvider(DataProvider[BatchT_co], Protocol[BatchT_co]):
    """A `DataProvider` that also knows how many steps one epoch has (`len(provider)`)."""

    def __len__(self) -> int:
        """Steps in one epoch."""
        ...


@runtime_checkable
class DeclaresSeqLen(Protocol):
    """A dataset whose samples all have one length, which it declares (every d9d.data dataset).

    The trainer checks it against context parallelism before anything runs.
    """

    @property
    def seq_len(self) -> int:
        """Tokens per sample."""
        ...


@runtime_checkable
class DeclaresVocabSize(Protocol):
    """A dataset that declares the vocabulary its ids come from (every d9d.data dataset).

    The trainer checks it against the model's input embedding before anything runs.
    """

    @property
    def vocab_size(self) -> int | None:
        """Every token id is below it; None when unknown."""
        ...


@runtime_checkable
class DeclaresSources(Protocol):
    """A dataset mixed from named sources (`MixtureDataset`): `AutoDataProvider` then counts the
    samples each source gives, from the indices alone (`AutoDataProvider.source_tokens`)."""

    @property
    def source_names(self) -> list[str]:
        """The sources' names, in source order."""
        ...

    def source_of(self, indices: Any) -> Any:
        """The source (its position in `source_names`) of each index in an int array."""
        ...


@runtime_checkable
class OrdersItself(Protocol):
    """A dataset that orders its own samples as one stream of indices 0, 1, 2, ... (past its length;
    `MixtureDataset`). `AutoDataProvider` reads it in stream order without shuffling (epoch e,
    position p is stream index e·len + p), keeps its `stream_state` in the data state, hands it back
    through `resume_stream` (where the dataset may continue with changed settings) and ends at
    `stream_end`."""

    @property
    def stream_end(self) -> int | None:
        """The first stream index past the data (None: endless)."""
        ...

    def stream_state(self, index: int) -> dict[str, Any]:
        """Plain values that resuming at stream index `index` needs."""
        ...

    def resume_stream(self, index: int, state: Mapping[str, Any]) -> list[str]:
        """Continue at `index` from a `stream_state`; returns what changed since it, a line each."""
        ...


@runtime_checkable
class ReportsSources(Protocol):
    """A data provider that reports on the named sources of its data (`AutoDataProvider` over a
    mixture): the tokens each gave so far, recorded per step, and what changed at a resume."""

    #: What `load_state_dict` found changed in the sources (e.g. mixture weights), a line each.
    resume_changes: list[str]

    def source_tokens(self) -> dict[str, int] | None:
        """Tokens each source gave over the run's steps so far; None when the data has no sources."""
        ...


@runtime_checkable
class DeclaresStepsLeft(Protocol):
    """A data provider whose data can run out: the trainer ends the run (with a checkpoint) after the
    last step it has."""

    @property
    def steps_left(self) -> int | None:
        """Steps the data still holds from the next one on (None: endless)."""
        ...


@runtime_checkable
class DeclaresDocumentMasking(Protocol):
    """A dataset whose samples may pack several documents that must not attend to each other.

    `document_masking` True: each sample carries `position_ids` and `document_ids` (see
    `d9d.data.block_causal_mask`); every d9d.data dataset declares it (packed SFT rows, token
    datasets with `document_masking`).
    """

    @property
    def document_masking(self) -> bool:
        """Whether samples carry `position_ids` and `document_ids`."""
        ...
