"""`PreparedDataset`: fixed-length causal-LM samples over a folder `prepare_dataset` wrote."""

import bisect
import collections
import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from d9d.data.datasets.packed import PackedTokens
from d9d.data.datasets.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from d9d.data.datasets.tokenizer_files import tokenizer_digest, tokenizer_files_at
from d9d.data.errors import DatasetError, TokenizerError
from d9d.data.prepare.index import PreparedIndex, read_index

__all__ = ["OPEN_SHARDS", "PreparedDataset"]

#: Shard files a `PreparedDataset` keeps open per process (least recently read closed first).
OPEN_SHARDS = 64


class PreparedDataset(PackedTokens):
    """Samples of `seq_len` tokens over the shards of a prepared folder, as one token sequence.

    The shards are concatenated in index order (each document already ends with the end-of-document
    token) and cut like `TokenFileDataset` cuts one file: sample i holds tokens [i·L, i·L + L] as
    inputs and labels shifted by one, a window that may span two shards. A window is read with one
    `pread` per shard it touches, from at most `OPEN_SHARDS` files kept open per process (a corpus of
    thousands of source files would otherwise run out of file descriptors), so memory does not grow
    with the number of documents; the dataset holds only the shards' cumulative token offsets.

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
        self._dtype = np.dtype(self._index.dtype).newbyteorder("<")
        self._open: collections.OrderedDict[int, int] = collections.OrderedDict()  # shard -> fd, LRU
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

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer the folder was prepared with: the copy of its files the folder keeps, the byte
        tokenizer, or (a folder prepared before d9d kept the copy) the tokenizer its index names, where
        that path, taken from the current directory or the folder's parent, still holds the same files.

        Raises:
            TokenizerError: it is in none of those places, or reading it needs `tokenizers`.
        """
        index = self._index
        if index.tokenizer_folder:
            return load_tokenizer(self._path / index.tokenizer_folder)
        if not index.tokenizer_sha256 and index.tokenizer == ByteTokenizer().name:
            return ByteTokenizer()
        named = Path(index.tokenizer)
        for place in dict.fromkeys([named, self._path.parent / named]):
            files = tokenizer_files_at(place)
            if files and index.tokenizer_sha256 in ("", tokenizer_digest(files)):
                return load_tokenizer(files["tokenizer.json"])
        raise TokenizerError(
            f"{self._path} was prepared with the tokenizer {index.tokenizer}, which is not there (from "
            f"{Path.cwd()}) with the same files, and the folder keeps no copy of it (prepared before d9d "
            "kept one); run the same d9d data prepare again (it adds the copy)"
        )

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
        """The ids of one shard, memory-mapped (a new map each call; the dataset itself reads with pread)."""
        info = self._index.shards[shard]
        return np.memmap(self._path / info.file, dtype=self._dtype, mode="r", shape=(info.tokens,))

    def _pread(self, shard: int, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of one shard, as int64."""
        fd = self._open.get(shard)
        if fd is None:
            if len(self._open) >= OPEN_SHARDS:
                os.close(self._open.popitem(last=False)[1])
            fd = self._open[shard] = os.open(self._path / self._index.shards[shard].file, os.O_RDONLY)
        else:
            self._open.move_to_end(shard)
        size = self._dtype.itemsize
        data = os.pread(fd, (hi - lo) * size, lo * size)
        if len(data) != (hi - lo) * size:
            raise DatasetError(
                f"{self._path / self._index.shards[shard].file} is shorter than its index says"
            )
        return np.frombuffer(data, dtype=self._dtype).astype(np.int64)

    def close(self) -> None:
        """Close the shard files this process has open (reading again reopens them)."""
        while self._open:
            os.close(self._open.popitem()[1])

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated shards, as int64."""
        starts = self._starts
        shard = bisect.bisect_right(starts, start) - 1
        if shard + 1 < len(starts) and stop <= starts[shard + 1]:  # within one shard: the common case
            base = starts[shard]
            return self._pread(shard, start - base, stop - base)
        parts = []
        position = start
        while position < stop and shard + 1 < len(starts):
            base = starts[shard]
            end = min(stop, starts[shard + 1])
            parts.append(self._pread(shard, position - base, end - base))
            position = end
            shard += 1
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers open their own files.
        return {**self.__dict__, "_open": collections.OrderedDict(), "_view": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view = _Concatenated(self)

    def __repr__(self) -> str:
        return (
            f"PreparedDataset({str(self._path)!r}, seq_len={self.seq_len}, shards={len(self._index.shards)}, "
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
