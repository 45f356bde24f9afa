"""Token files: a flat binary of uint16/uint32 token ids, memory-mapped, with a small JSON sidecar."""

import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from d9d.data.datasets.packed import PackedTokens, find_text_files, token_dtype
from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError

__all__ = ["TokenFileDataset", "TokenFileInfo", "write_token_file"]

_CHUNK_CHARS = 1 << 20


class TokenFileInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the sidecar `<token file>.json` records about a token file."""

    dtype: str
    num_tokens: int
    vocab_size: int
    eos_id: int | None
    tokenizer: str
    sources: list[str] = []


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where the JSON description of a token file lives: next to it, with ".json" appended."""
    path = Path(path)
    return path.with_name(path.name + ".json")


class TokenFileDataset(PackedTokens):
    """Fixed-length causal-LM samples from a flat binary of token ids, memory-mapped (never read whole).

    Sample i is {"input_ids": tokens[i·L : i·L+L], "labels": tokens[i·L+1 : i·L+L+1]} as int64
    tensors, for L = seq_len; there are (num_tokens − 1) // L samples.

    Args:
        path: the token file (little-endian uint16 or uint32 ids, no header).
        seq_len: tokens per sample.
        dtype: "uint16" or "uint32"; by default read from the sidecar that `write_token_file` writes.
        document_masking: add `position_ids` and `document_ids` to every sample (see `PackedTokens`);
            needs the sidecar's `eos_id`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        *,
        dtype: str | None = None,
        document_masking: bool = False,
    ) -> None:
        super().__init__(seq_len, document_masking=document_masking)
        self._path = Path(path)
        if not self._path.is_file():
            raise DatasetError(
                f"no token file at {self._path}; create one from text with d9d.data.write_token_file"
            )
        sidecar = sidecar_path(self._path)
        self._info: TokenFileInfo | None = None
        if sidecar.is_file():
            try:
                self._info = msgspec.json.decode(sidecar.read_bytes(), type=TokenFileInfo)
            except msgspec.DecodeError as exc:
                raise DatasetError(
                    f"{sidecar} is not a valid token-file description ({exc}); rewrite the token file with "
                    "write_token_file, or delete the sidecar and pass dtype="
                ) from exc
        if dtype is None and self._info is None:
            raise DatasetError(
                f"{self._path} has no sidecar {sidecar.name} naming its dtype; pass dtype='uint16' or 'uint32'"
            )
        self._dtype = token_dtype(dtype if dtype is not None else self._info.dtype if self._info else None)
        size = self._path.stat().st_size
        if size % self._dtype.itemsize:
            raise DatasetError(
                f"{self._path} has {size} bytes, not a whole number of {self._dtype.name} tokens; "
                "the file is truncated or the dtype is wrong"
            )
        self._num_tokens = size // self._dtype.itemsize
        self._tokens: np.ndarray | None = None
        self._check_enough_tokens(str(self._path))
        self._check_document_masking(str(self._path))

    @property
    def path(self) -> Path:
        """The token file."""
        return self._path

    @property
    def info(self) -> TokenFileInfo | None:
        """The sidecar's description (tokenizer, vocabulary, sources), if there is one."""
        return self._info

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size recorded in the sidecar (`write_token_file`), None without one."""
        return self._info.vocab_size if self._info is not None else None

    @property
    def eos_id(self) -> int | None:
        """The end-of-document token recorded in the sidecar, None without one."""
        return self._info.eos_id if self._info is not None else None

    @property
    def num_tokens(self) -> int:
        """Tokens in the file."""
        return self._num_tokens

    @property
    def tokens(self) -> np.ndarray:
        """The memory-mapped token ids (opened on first use in each process)."""
        if self._tokens is None:
            self._tokens = np.memmap(self._path, dtype=self._dtype, mode="r", shape=(self._num_tokens,))
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers reopen the map instead of receiving a copy of the whole file.
        return {**self.__dict__, "_tokens": None}

    def __repr__(self) -> str:
        return f"TokenFileDataset({str(self._path)!r}, seq_len={self.seq_len}, samples={len(self)})"


def write_token_file(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    dtype: str | None = None,
    progress: bool = True,
    stream: IO[str] | None = None,
) -> TokenFileInfo:
    """Tokenize text files once into a token file (and its sidecar) for `TokenFileDataset`.

    Each file is one document, followed by the tokenizer's end-of-document token when it has one.
    The file is written under a temporary name and renamed when complete.

    Args:
        sources: a text file, a folder (its *.txt files, sorted) or a list of them.
        output: the token file to write; its description goes to `<output>.json`.
        tokenizer: None for the built-in byte-level tokenizer, a tokenizer.json path, or a `Tokenizer`.
        dtype: "uint16" or "uint32"; by default the smallest that holds the vocabulary.
        progress: show a progress bar (bytes of text read) on `stream` (default stderr).
    """
    files = find_text_files(sources)
    tok = resolve_tokenizer(tokenizer)
    np_dtype = token_dtype(dtype, tok.vocab_size)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    bar = _Progress(sum(f.stat().st_size for f in files), stream or sys.stderr, enabled=progress)
    num_tokens = 0
    try:
        with tmp.open("wb") as out:
            for file in files:
                for chunk, nbytes in _read_chunks(file):
                    ids = np.asarray(tok.encode(chunk))
                    ids.astype(np_dtype, copy=False).tofile(out)
                    num_tokens += len(ids)
                    bar.update(nbytes, num_tokens)
                if tok.eos_id is not None:
                    np.asarray([tok.eos_id], dtype=np_dtype).tofile(out)
                    num_tokens += 1
        info = TokenFileInfo(
            dtype=np_dtype.name,
            num_tokens=num_tokens,
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            tokenizer=tok.name,
            sources=[str(f) for f in files],
        )
        sidecar_path(output).write_bytes(msgspec.json.format(msgspec.json.encode(info)))
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
        bar.close(num_tokens)
    return info


def _read_chunks(file: Path) -> Iterator[tuple[str, int]]:
    """The text of `file` in pieces of about a megabyte, cut after a newline, with their size in bytes."""
    with file.open("r", encoding="utf-8", errors="replace", newline="") as handle:
        while True:
            chunk = handle.read(_CHUNK_CHARS)
            if not chunk:
                return
            if not chunk.endswith("\n"):
                chunk += handle.readline()
            yield chunk, len(chunk.encode("utf-8"))


class _Progress:
    """A one-line progress bar on a terminal; a single summary line when output is not a terminal."""

    def __init__(self, total_bytes: int, stream: IO[str], *, enabled: bool) -> None:
        self._total = max(total_bytes, 1)
        self._stream = stream
        self._enabled = enabled
        self._tty = enabled and stream.isatty()
        self._done = 0
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, nbytes: int, num_tokens: int) -> None:
        self._done += nbytes
        now = time.monotonic()
        if self._tty and now - self._last >= 0.1:
            self._last = now
            self._stream.write("\r" + self._line(num_tokens))
            self._stream.flush()

    def close(self, num_tokens: int) -> None:
        if not self._enabled:
            return
        self._stream.write(("\r" if self._tty else "") + self._line(num_tokens) + "\n")
        self._stream.flush()

    def _line(self, num_tokens: int) -> str:
        fraction = min(self._done / self._total, 1.0)
        filled = int(fraction * 30)
        elapsed = max(time.monotonic() - self._start, 1e-9)
        return (
            f"tokenizing [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%} "
            f"{self._done / 1e6:.1f}/{self._total / 1e6:.1f} MB, {num_tokens:,} tokens, "
            f"{self._done / 1e6 / elapsed:.1f} MB/s"
        )
