"""`PreparedDataset`: fixed-length causal-LM samples over a folder `prepare_dataset` wrote."""

import bisect
import os
from pathlib import Path
from typing import Any

import numpy as np

from d9d.data.datasets.packed import PackedTokens
from d9d.data.errors import DatasetError
from d9d.data.prepare import PreparedIndex, read_index

__all__ = ["PreparedDataset"]


class PreparedDataset(PackedTokens):
    """Samples of `seq_len` tokens over the shards of a prepared folder, as one token sequence.

    The shards are concatenated in index order (each document already ends with the end-of-document
    token) and cut like `TokenFileDataset` cuts one file: sample i holds tokens [i·L, i·L + L] as
    inputs and labels shifted by one, a window that may span two shards. Every shard is memory-mapped
    on first use in each process, so memory does not grow with the number of documents; the dataset
    holds only the shards' cumulative token offsets.

    Args:
        path: the prepared folder (`d9d data prepare --out`).
        seq_len: tokens per sample.
        document_masking: add `position_ids` and `document_ids` from the end-of-document tokens (see
            `PackedTokens`), so packed documents do not attend to each other.

    Raises:
        DatasetError: no index (an unfinished prepare), a shard whose size disagrees with the index,
            or too few tokens for one sample.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, *, document_masking: bool = False) -> None:
        super().__init__(seq_len, document_masking=document_masking)
        self._path = Path(path)
        self._index = read_index(self._path)
        itemsize = np.dtype(self._index.dtype).itemsize
        for shard in self._index.shards:
            file = self._path / shard.file
            size = file.stat().st_size if file.is_file() else None
            if size != shard.tokens * itemsize:
                found = "missing" if size is None else f"{size} bytes"
                raise DatasetError(
                    f"{file} is {found}, but {self._path / 'index.json'} says {shard.tokens * itemsize} bytes; "
                    "the folder is damaged: prepare it again"
                )
        self._offsets = np.cumsum([0] + [s.tokens for s in self._index.shards], dtype=np.int64)
        self._starts = self._offsets.tolist()  # Python ints: bisect on them is the fast scalar lookup
        self._view = _Concatenated(self)
        self._maps: list[np.ndarray | None] = [None] * len(self._index.shards)
        self._check_enough_tokens(str(self._path))
        self._check_document_masking(str(self._path))

    @property
    def path(self) -> Path:
        """The prepared folder."""
        return self._path

    @property
    def index(self) -> PreparedIndex:
        """The folder's index (shards, tokenizer, vocabulary)."""
        return self._index

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (every id is below it)."""
        return self._index.vocab_size

    @property
    def eos_id(self) -> int:
        """The end-of-document token after every document."""
        return self._index.eos_id

    @property
    def num_tokens(self) -> int:
        """Tokens in all shards."""
        return int(self._offsets[-1])

    @property
    def tokens(self) -> "_Concatenated":
        """The shards as one sequence (slices read only the shards they touch)."""
        return self._view

    def shard_tokens(self, shard: int) -> np.ndarray:
        """The memory-mapped ids of one shard (opened on first use in each process)."""
        array = self._maps[shard]
        if array is None:
            info = self._index.shards[shard]
            array = np.memmap(self._path / info.file, dtype=self._index.dtype, mode="r", shape=(info.tokens,))
            self._maps[shard] = array
        return array

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated shards, as int64."""
        starts = self._starts
        shard = bisect.bisect_right(starts, start) - 1
        if shard + 1 < len(starts) and stop <= starts[shard + 1]:  # within one shard: the common case
            base = starts[shard]
            return np.asarray(self.shard_tokens(shard)[start - base : stop - base], dtype=np.int64)
        parts = []
        position = start
        while position < stop and shard < len(self._maps):
            base = starts[shard]
            end = min(stop, starts[shard + 1])
            parts.append(np.asarray(self.shard_tokens(shard)[position - base : end - base], dtype=np.int64))
            position = end
            shard += 1
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers reopen the maps instead of receiving copies of the shards.
        return {**self.__dict__, "_maps": [None] * len(self._maps), "_view": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view = _Concatenated(self)

    def __repr__(self) -> str:
        return (
            f"PreparedDataset({str(self._path)!r}, seq_len={self.seq_len}, shards={len(self._maps)}, "
            f"samples={len(self)})"
        )


class _Concatenated:
    """Slicing view of a `PreparedDataset`'s shards as one sequence (what `PackedTokens` indexes)."""

    def __init__(self, dataset: PreparedDataset) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return self._dataset.num_tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a prepared dataset's tokens take contiguous slices only")
        start, stop, _ = key.indices(len(self))
        return self._dataset.read(start, max(start, stop))
