"""`MixtureDataset`: several datasets of equal-length samples mixed by weight, computed per index.

Index i of the mixture lies in block i // B (B = `BLOCK` samples); every block gives each source the
same number of slots, its weight's share of B apportioned by largest remainder, in source order
(slot r of a block belongs to the source whose slot range holds r). Source s's k-th slot overall is
its local sample k; a source that runs out continues with a new pass over its samples, each pass in
its own seeded order (`epoch_order(len_s, seed, pass)`). So a source's share of the samples is its
apportioned share of a block (within 1/B of its weight), every index is computed in O(1) time and
memory from the index alone, and the data provider's own order (shuffled positions, data-parallel
slices, resume on any mesh) works on the mixture as on any dataset.

Length: with `exhausted="repeat"` (default) the mixture is long enough for the source that needs
the most samples at its weight to be seen whole once (the others repeat, or are seen in part, the
part a block at a time); with `exhausted="stop"` it ends before any source would repeat.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from d9d.data.errors import DatasetError
from d9d.data.order import EpochOrder, epoch_order

__all__ = ["BLOCK", "MixtureDataset", "apportion"]

#: Samples per block of the mixture: each block holds every source's apportioned slots.
BLOCK = 1024


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """`total` slots split by `weights` (largest remainder; ties to the earlier source): the counts
    sum to `total` and each is within 1 of its exact share."""
    norm = sum(weights)
    exact = [w / norm * total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDataset:
    """Samples of several datasets (of one `seq_len`) in proportion to their weights (see the module
    docstring).

    Args:
        sources: the datasets; each must have a length and return samples of the same shape.
        weights: one positive weight per source (any scale: they are normalized).
        names: one name per source, for `source_of` and logs (default: "0", "1", ...).
        seed: seed of each source's pass orders.
        exhausted: "repeat" (a source that runs out starts a new pass) or "stop" (the mixture ends
            before any source would).

    Raises:
        DatasetError: no source, a weight that is not positive, an empty source, a source too small
            for its share of one block with `exhausted="stop"`, mismatched `seq_len`s.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        *,
        names: Sequence[str] | None = None,
        seed: int = 0,
        exhausted: Literal["repeat", "stop"] = "repeat",
    ) -> None:
        if not sources:
            raise DatasetError("a mixture needs at least one source")
        if len(weights) != len(sources):
            raise DatasetError(
                f"a mixture of {len(sources)} sources got {len(weights)} weights; give one each"
            )
        names = [str(i) for i in range(len(sources))] if names is None else [str(n) for n in names]
        if len(names) != len(sources):
            raise DatasetError(f"a mixture of {len(sources)} sources got {len(names)} names; give one each")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise DatasetError(
                f"mixture source names must differ; {', '.join(twice)} is given twice: name them"
            )
        for name, weight in zip(names, weights, strict=True):
            bad = isinstance(weight, bool) or not isinstance(weight, int | float)
            if bad or not (weight > 0 and math.isfinite(weight)):
                raise DatasetError(
                    f"the weight of mixture source {name} must be a finite number > 0, got {weight!r}"
                )
        if exhausted not in ("repeat", "stop"):
            raise DatasetError(f"exhausted must be 'repeat' or 'stop', got {exhausted!r}")
        lengths = [len(source) for source in sources]
        for name, length in zip(names, lengths, strict=True):
            if length == 0:
                raise DatasetError(f"mixture source {name} holds no samples; remove it or add data")
        seq_lens = {getattr(s, "seq_len", None) for s in sources} - {None}
        if len(seq_lens) > 1:
            raise DatasetError(
                f"the mixture's sources have different seq_len ({sorted(seq_lens)}); give them one"
            )
        for attribute, what in (
            ("vocab_size", "tokenized with different vocabularies"),
            ("eos_id", "tokenized with different end-of-document tokens"),
            ("document_masking", "built with and without document masking"),
        ):
            values = {n: getattr(src, attribute, None) for n, src in zip(names, sources, strict=True)}
            known = {v for v in values.values() if v is not None}
            if len(known) > 1:
                shown = ", ".join(f"{n}: {v}" for n, v in values.items())
                raise DatasetError(
                    f"the mixture's sources were {what} ({attribute}: {shown}); prepare them with one "
                    "tokenizer and one setting"
                )
        self._sources = list(sources)
        self._names = names
        self._weights = [float(w) for w in weights]
        self._lengths = lengths
        self._seed = seed
        self._exhausted = exhausted
        self._counts = apportion(self._weights, BLOCK)
        for name, count, weight in zip(names, self._counts, self._weights, strict=True):
            if count == 0:
                share = weight / sum(self._weights)
                raise DatasetError(
                    f"mixture source {name}'s weight is {share:.2e} of the total, less than one sample in a "
                    f"block of {BLOCK}, so it would never be sampled; raise its weight or remove it"
                )
        self._starts = np.cumsum([0, *self._counts])  # slot range of each source in a block
        # Blocks needed to see each source once: the mixture's length covers the largest (repeat) or
        # the smallest (stop) of them.
        if exhausted == "repeat":
            blocks = max(math.ceil(n / c) for n, c in zip(lengths, self._counts, strict=True))
        else:
            blocks = min(n // c for n, c in zip(lengths, self._counts, strict=True))
            if blocks == 0:
                small = [nm for nm, n, c in zip(names, lengths, self._counts, strict=True) if n < c]
                raise DatasetError(
                    f"with exhausted: stop, mixture source {small[0]} has fewer samples than its share of one "
                    f"block of {BLOCK}; use exhausted: repeat or add data"
                )
        self._blocks = blocks
        self._seq_len = seq_lens.pop() if seq_lens else None
        self._orders: dict[tuple[int, int], EpochOrder] = {}  # (source, pass) -> its order, a few at once

    @property
    def names(self) -> list[str]:
        """The sources' names, in order."""
        return list(self._names)

    @property
    def source_names(self) -> list[str]:
        """The sources' names (`d9d.data.DeclaresSources`: the data provider counts their tokens)."""
        return list(self._names)

    @property
    def weights(self) -> list[float]:
        """The sources' weights as given."""
        return list(self._weights)

    @property
    def shares(self) -> list[float]:
        """Each source's share of the samples (its slots per block / `BLOCK`)."""
        return [c / BLOCK for c in self._counts]

    @property
    def sources(self) -> list[Any]:
        """The datasets, in order."""
        return list(self._sources)

    @property
    def seq_len(self) -> int | None:
        """The sources' common sample length."""
        return self._seq_len

    @property
    def vocab_size(self) -> int | None:
        """The sources' vocabulary (one: differing ones are refused; None when one is unknown)."""
        sizes = [getattr(s, "vocab_size", None) for s in self._sources]
        return None if any(v is None for v in sizes) else max(sizes)

    @property
    def document_masking(self) -> bool | None:
        """Whether every source adds document ids (None when one does not say)."""
        flags = {getattr(s, "document_masking", None) for s in self._sources}
        return flags.pop() if len(flags) == 1 else None

    def __len__(self) -> int:
        return self._blocks * BLOCK

    def locate(self, index: int) -> tuple[int, int]:
        """(source, index into that source) of mixture index `index`."""
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for a mixture of {n} samples")
        index %= n
        block, slot = divmod(index, BLOCK)
        source = int(np.searchsorted(self._starts, slot, side="right")) - 1
        k = block * self._counts[source] + (slot - int(self._starts[source]))
        length = self._lengths[source]
        passes, position = divmod(k, length)
        order = self._orders.get((source, passes))
        if order is None:
            if len(self._orders) >= 64:
                self._orders.clear()
            order = self._orders[(source, passes)] = epoch_order(length, seed=self._seed, epoch=passes)
        return source, int(order[position])

    def locate_many(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`locate` of every mixture index in `indices`, vectorized: (sources, indices into them)."""
        indices = np.asarray(indices, dtype=np.int64) % len(self)
        blocks, slots = np.divmod(indices, BLOCK)
        sources = np.searchsorted(self._starts, slots, side="right") - 1
        counts = np.asarray(self._counts, dtype=np.int64)[sources]
        k = blocks * counts + (slots - self._starts[sources])
        lengths = np.asarray(self._lengths, dtype=np.int64)[sources]
        passes, positions = np.divmod(k, lengths)
        local = np.empty_like(indices)
        for source, passed in {(int(a), int(b)) for a, b in zip(sources, passes, strict=True)}:
            chosen = (sources == source) & (passes == passed)
            order = epoch_order(self._lengths[source], seed=self._seed, epoch=passed)
            local[chosen] = order.indices(positions[chosen])
        return sources, local

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each mixture index in `indices` (vectorized, no sample is loaded)."""
        slots = np.asarray(indices, dtype=np.int64) % BLOCK
        return np.searchsorted(self._starts, slots, side="right") - 1

    def __getitem__(self, index: int) -> Any:
        source, local = self.locate(index)
        return self._sources[source][local]

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {s:.3f}" for n, s in zip(self._names, self.shares, strict=True))
        return f"MixtureDataset({parts}; {len(self)} samples, exhausted={self._exhausted})"
