"""The dataset provider and the data-provider factory; batching declared from the config alone."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from d9d.data import DataProvider, DeclaresDocumentMasking, DeclaresSeqLen, DeclaresVocabSize, Tokenizer
from d9d.mesh import DistributedContext, MeshConfig


@dataclass(frozen=True)
class BuildDatasetContext:
    """What a dataset provider may look at (e.g. to let only local rank 0 prepare files)."""

    context: DistributedContext
    base_dir: Any


@dataclass(frozen=True)
class BuildDatasetResult:
    """A map-style dataset, the function that collates a list of its samples into a batch, and what
    the plan checks against the mesh and the model.

    Attributes:
        seq_len: tokens per sample, checked against context parallelism before the model is built;
            None when samples have no one length. When not given, the dataset's own `seq_len` (an
            int attribute: `d9d.data.DeclaresSeqLen`, as every d9d.data dataset has).
        vocab_size: every token id is below it, checked against the model's input embedding; None
            when unknown. When not given, the dataset's own (`d9d.data.DeclaresVocabSize`).
        document_masking: samples pack documents that must not attend to each other (they carry
            `position_ids` and `document_ids`), checked against context parallelism; None when
            unknown. When not given, the dataset's own (`d9d.data.DeclaresDocumentMasking`).
        tokenizer: the `d9d.data.Tokenizer` the samples were encoded with (`d9d generate` encodes
            prompts and decodes text with it); None when unknown. When not given, the dataset's own
            `tokenizer` attribute (d9d.data's text and chat datasets have one).
    """

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    document_masking: bool | None = None
    tokenizer: Tokenizer | None = None

    def __post_init__(self) -> None:
        if self.seq_len is None and isinstance(self.dataset, DeclaresSeqLen):
            object.__setattr__(self, "seq_len", _count(self.dataset.seq_len))
        if self.vocab_size is None and isinstance(self.dataset, DeclaresVocabSize):
            object.__setattr__(self, "vocab_size", _count(self.dataset.vocab_size))
        if self.document_masking is None and isinstance(self.dataset, DeclaresDocumentMasking):
            masking = self.dataset.document_masking
            object.__setattr__(self, "document_masking", masking if isinstance(masking, bool) else None)
        if self.tokenizer is None:
            found = getattr(self.dataset, "tokenizer", None)
            object.__setattr__(self, "tokenizer", found if isinstance(found, Tokenizer) else None)


def _count(value: object) -> int | None:
    """`value` when it is an int (a declared length or size), else None (nothing declared)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@runtime_checkable
class DatasetProvider(Protocol):
    """Builds the training dataset (the `dataset:` section is its config)."""

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        """Return the dataset."""
        ...


@dataclass(frozen=True)
class BuildDataProviderContext:
    """What a data-provider factory receives."""

    context: DistributedContext
    dataset: BuildDatasetResult | None
    pipeline_stages: Any = "all"


@runtime_checkable
class DataProviderFactory(Protocol):
    """Builds the data provider (the `data:` section is its config)."""

    def build_data_provider(self, context: BuildDataProviderContext) -> DataProvider[Any]:
        """Return the provider that yields each step's microbatches."""
        ...


@dataclass(frozen=True)
class Batching:
    """How a data provider batches each step, as its factory declares it (`DeclaresBatching`).

    Attributes:
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        microbatch_size: samples per microbatch.
        microbatches_per_step: microbatches each data-parallel rank runs per step.
        data_parallel: the data-parallel ranks the global batch is split over.
    """

    global_batch_size: int
    microbatch_size: int
    microbatches_per_step: int
    data_parallel: int


@runtime_checkable
class DeclaresBatching(Protocol):
    """A data-provider factory that says how it will batch, from the config alone (no data read).

    Needed for mesh.pipeline_parallel > 1 (the schedule is built for the microbatch count); `d9d plan`
    prints it, and the trainer logs it.
    """

    def batching(self, mesh: MeshConfig) -> Batching:
        """The batching on `mesh`; raise a `d9d.data.BatchSizeError` when the batch does not split."""
        ...


@runtime_checkable
class SupportsClose(Protocol):
    """A data provider with resources to release (worker threads, files) when the trainer closes."""

    def close(self) -> None:
        """Release them; called once."""
        ...
