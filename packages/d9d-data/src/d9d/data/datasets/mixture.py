"""`MixtureDataset`: several datasets of equal-length samples mixed by weight, as one stream of indices.

The mixture orders its own samples (`d9d.data.OrdersItself`): index g = 0, 1, 2, ... of the stream (any
g, past `len`) lies in block g // B (B = `BLOCK` samples). Every block gives each source the same
number of slots, its weight's share of B apportioned by largest remainder, interleaved evenly (slot j
goes to the source furthest behind its share of the first j + 1 slots, ties to the earlier source), so
every prefix of a block, and so every step, holds each source within a sample of its share. Source
s's k-th slot overall is its local sample k: the samples of a source are read in passes, each pass in
its own seeded order (`epoch_order(len_s, seed, pass)`), and a source that runs out continues with a
new pass (`exhausted="repeat"`) or ends the stream (`exhausted="stop"`: `stream_end` is the first
index at which a source would repeat). Any index is computed in O(1) memory from the index alone.

A source's slots are consumed as a prefix (its k-th slot before its (k+1)-th), so the stream can
continue with other weights: `resume_stream` starts a new segment at the resume index in which each
source goes on from the slot it had reached, at its new share. Sources are matched by name; one new
in the mixture starts at its first sample, one no longer in it is dropped.

`AutoDataProvider` reads an `OrdersItself` dataset in stream order (epoch e, position p is index
e·len + p; `data.shuffle` does not apply: the mixture shuffles each source's passes), slices each
step over data-parallel ranks as usual, and keeps `stream_state` in its checkpointed state, so the
stream resumes exactly on another world size and microbatch size. `len` is the sum of the sources'
lengths (an epoch of the provider is as many samples as the sources hold), whatever the weights.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from d9d.data.errors import DatasetError, DataStateError
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


class _Segment:
    """Stream indices from `start` on, at slot counts `counts` per block, each source going on from
    slot `offsets[s]`: the block's interleave, and which slot of which source any index is."""

    def __init__(self, counts: Sequence[int], start: int, offsets: Sequence[int]) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.start = int(start)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        taken = np.zeros(len(counts), dtype=np.int64)
        self.source_at = np.empty(BLOCK, dtype=np.int64)  # slot j of a block: its source
        self.rank_at = np.empty(BLOCK, dtype=np.int64)  # ... and its rank among that source's slots
        self.taken_before = np.zeros((BLOCK + 1, len(counts)), dtype=np.int64)  # slots per source in [0, j)
        for j in range(BLOCK):
            deficit = (j + 1) * self.counts - taken * BLOCK  # (share of j + 1 slots - taken) × BLOCK
            deficit[taken >= self.counts] = np.iinfo(np.int64).min
            s = int(np.argmax(deficit))
            self.source_at[j], self.rank_at[j] = s, taken[s]
            taken[s] += 1
            self.taken_before[j + 1] = taken

    def slots(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, slot k of that source) of each stream index (all >= `start`)."""
        blocks, j = np.divmod(indices - self.start, BLOCK)
        sources = self.source_at[j]
        return sources, self.offsets[sources] + blocks * self.counts[sources] + self.rank_at[j]

    def taken(self, index: int) -> np.ndarray:
        """Slots of each source consumed before stream index `index` (>= `start`)."""
        blocks, j = divmod(index - self.start, BLOCK)
        return self.offsets + blocks * self.counts + self.taken_before[j]

    def end(self, lengths: np.ndarray) -> int:
        """The first stream index at which a source would begin its second pass."""
        left = lengths - self.offsets
        if np.any(left < 0):
            return self.start
        blocks = int(np.min(left // self.counts))
        # Slots j of the next block that still fit: [0, first misfit) (taken_before[BLOCK] never fits).
        fits = np.all(self.taken_before <= left - blocks * self.counts, axis=1)
        return self.start + blocks * BLOCK + int(np.argmin(fits)) - 1


class MixtureDataset:
    """Samples of several datasets (of one `seq_len`) in proportion to their weights, as one stream
    (see the module docstring).

    Args:
        sources: the datasets; each must have a length and return samples of the same shape.
        weights: one positive weight per source (any scale: they are normalized).
        names: one name per source, for `source_of`, logs and resuming (default: "0", "1", ...).
        seed: seed of each source's pass orders.
        exhausted: "repeat" (a source that runs out starts a new pass) or "stop" (the stream ends
            before any source would; `stream_end`).

    Raises:
        DatasetError: no source, a weight that is not positive, an empty source, a weight too small
            for one slot of a block, mismatched `seq_len`s, vocabularies, EOS or document masking.
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
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self._seed = seed
        self._exhausted = exhausted
        counts = apportion(self._weights, BLOCK)
        for name, count, weight in zip(names, counts, self._weights, strict=True):
            if count == 0:
                share = weight / sum(self._weights)
                raise DatasetError(
                    f"mixture source {name}'s weight is {share:.2e} of the total, less than one sample in a "
                    f"block of {BLOCK}, so it would never be sampled; raise its weight or remove it"
                )
        self._segment = _Segment(counts, 0, [0] * len(counts))
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
        return [int(c) / BLOCK for c in self._segment.counts]

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
        return int(self._lengths.sum())

    @property
    def stream_start(self) -> int:
        """The first stream index of the current weights (0, or where a resume changed them)."""
        return self._segment.start

    @property
    def stream_end(self) -> int | None:
        """With `exhausted="stop"`, the first stream index at which a source would repeat; else None."""
        return self._segment.end(self._lengths) if self._exhausted == "stop" else None

    def locate_many(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index into that source) of every stream index in `indices`, vectorized."""
        indices = np.asarray(indices, dtype=np.int64)
        self._check(indices)
        sources, k = self._segment.slots(indices)
        lengths = self._lengths[sources]
        passes, positions = np.divmod(k, lengths)
        local = np.empty_like(indices)
        for source, passed in {(int(a), int(b)) for a, b in zip(sources, passes, strict=True)}:
            chosen = (sources == source) & (passes == passed)
            local[chosen] = self._order(source, passed).indices(positions[chosen])
        return sources, local

    def locate(self, index: int) -> tuple[int, int]:
        """(source, index into that source) of stream index `index`."""
        sources, local = self.locate_many(np.asarray([index]))
        return int(sources[0]), int(local[0])

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each stream index in `indices` (vectorized, no sample is loaded)."""
        indices = np.asarray(indices, dtype=np.int64)
        self._check(indices)
        return self._segment.source_at[(indices - self._segment.start) % BLOCK]

    def __getitem__(self, index: int) -> Any:
        source, local = self.locate(index)
        return self._sources[source][local]

    def _order(self, source: int, passed: int) -> EpochOrder:
        order = self._orders.get((source, passed))
        if order is None:
            if len(self._orders) >= 64:
                self._orders.clear()
            length = int(self._lengths[source])
            order = self._orders[(source, passed)] = epoch_order(length, seed=self._seed, epoch=passed)
        return order

    def _check(self, indices: np.ndarray) -> None:
        if not indices.size:
            return
        low, high, end = int(indices.min()), int(indices.max()), self.stream_end
        if low < self._segment.start:
            raise IndexError(
                f"stream index {low} comes before this mixture's current weights (they start at "
                f"{self._segment.start})"
            )
        if end is not None and high >= end:
            raise IndexError(
                f"stream index {high} is past the end of the mixture (exhausted: stop, at {end})"
            )

    # ------------------------------------------------------------------ resuming

    def stream_state(self, index: int) -> dict[str, Any]:
        """What resuming at stream index `index` needs (plain values): the sources' names, weights
        and lengths, and the slot each source reached by `index`."""
        taken = self._segment.taken(index)
        return {
            "names": list(self._names),
            "weights": list(self._weights),
            "lengths": self._lengths.tolist(),
            "taken": taken.tolist(),
            "start": self._segment.start,
            "exhausted": self._exhausted,
        }

    def resume_stream(self, index: int, state: Mapping[str, Any]) -> list[str]:
        """Continue the stream saved as `state` (`stream_state(index)` of the saved run) at `index`.

        With the saved weights, the stream is the saved run's, exactly. With other weights, or sources
        added or removed, a new segment starts at `index`: each source goes on from the slot it had
        reached, at its new share. Returns the changes, one line each (empty when none).

        Raises:
            DataStateError: the state is malformed, or a source kept by name has another length (its
                pass orders, and so which samples it has given, would differ).
        """
        try:
            names = [str(n) for n in state["names"]]
            weights = [float(w) for w in state["weights"]]
            lengths = [int(n) for n in state["lengths"]]
            taken = [int(t) for t in state["taken"]]
            start = int(state["start"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataStateError(
                f"the saved mixture state is malformed ({exc!r}); the checkpoint's data state is corrupt"
            ) from None
        if not len(names) == len(weights) == len(lengths) == len(taken) or not 0 <= start <= index:
            raise DataStateError(
                "the saved mixture state is inconsistent; the checkpoint's data state is corrupt"
            )
        saved = dict(zip(names, zip(weights, lengths, taken, strict=True), strict=True))
        resized = [
            f"{n} (saved {saved[n][1]}, now {int(length)})"
            for n, length in zip(self._names, self._lengths, strict=True)
            if n in saved and saved[n][1] != int(length)
        ]
        if resized:
            raise DataStateError(
                f"mixture source {resized[0]} samples: its sample order, and so which samples it has given, "
                "would differ; restore the source the run was saved with, or start a new run"
            )
        if names == self._names and weights == self._weights and state.get("exhausted") == self._exhausted:
            # The same mixture: the saved segment, rebuilt from its start (where `taken` was at `start`).
            segment = self._segment  # starts at 0 from offsets 0: taken(i) counts the slots of [0, i)
            self._segment = _Segment(segment.counts, start, np.asarray(taken) - segment.taken(index - start))
            return []
        offsets = [saved[n][2] if n in saved else 0 for n in self._names]
        self._segment = _Segment(self._segment.counts, index, offsets)
        old = {n: c / BLOCK for n, c in zip(names, apportion(weights, BLOCK), strict=True)}
        new = dict(zip(self._names, self.shares, strict=True))
        changes = [
            f"{n}: {old.get(n, 0.0):.4f} -> {new.get(n, 0.0):.4f}"
            for n in dict.fromkeys([*names, *self._names])
            if round(old.get(n, 0.0), 4) != round(new.get(n, 0.0), 4) or (n in old) != (n in new)
        ]
        if state.get("exhausted") != self._exhausted:
            changes.append(f"exhausted: {state.get('exhausted')} -> {self._exhausted}")
        return changes or ["the weights' scale changed; the shares are the same"]

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {s:.3f}" for n, s in zip(self._names, self.shares, strict=True))
        return f"MixtureDataset({parts}; {len(self)} samples a pass, exhausted={self._exhausted})"
