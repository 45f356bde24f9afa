"""Tokenizers: the built-in byte-level one, and a local `tokenizer.json` when `tokenizers` is installed."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from d9d.data.errors import TokenizerError

__all__ = ["ByteTokenizer", "Tokenizer", "load_tokenizer"]

_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """Turns text into token ids and back; `eos_id` (if any) separates documents when packing."""

    @property
    def name(self) -> str:
        """A short description stored with token files ("byte", or the tokenizer file's path)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (every id is below it)."""
        ...

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-document token, or None to concatenate documents without a separator."""
        ...

    def encode(self, text: str) -> np.ndarray | Sequence[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus an end-of-document token (256): no files, no training."""

    @property
    def name(self) -> str:
        """Always "byte"."""
        return "byte"

    @property
    def vocab_size(self) -> int:
        """257: the 256 byte values and the end-of-document token."""
        return 257

    @property
    def eos_id(self) -> int:
        """256."""
        return 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as uint16 ids."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of the byte ids; other ids (end-of-document) become newlines."""
        array = np.asarray(ids, dtype=np.int64)
        data = np.where(array < 256, array, ord("\n")).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class _HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local tokenizer.json, behind the `Tokenizer` protocol."""

    def __init__(self, path: Path, tokenizer: Any) -> None:
        self._path = path
        self._tokenizer = tokenizer
        self._eos_id: int | None = next(
            (i for t in _EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None), None
        )

    @property
    def name(self) -> str:
        return str(self._path)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids]))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self._path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        loaded = load_tokenizer(state["path"])
        assert isinstance(loaded, _HFTokenizer)
        self.__dict__.update(loaded.__dict__)

    def __repr__(self) -> str:
        return f"load_tokenizer({str(self._path)!r})"


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a local Hugging Face `tokenizer.json` (a file, or a folder that holds one).

    Needs the optional `tokenizers` package; d9d-data does not depend on it.

    Raises:
        TokenizerError: the file is missing or `tokenizers` is not installed.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise TokenizerError(
            f"no tokenizer file at {file}; pass the path of a local tokenizer.json (or a folder holding "
            "one), or use the built-in byte-level tokenizer (tokenizer=None)"
        )
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            f"reading {file} needs the optional `tokenizers` package, which is not installed; install it "
            "(`uv pip install tokenizers`) or use the built-in byte-level tokenizer (tokenizer=None)"
        ) from None
    try:
        loaded = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:
        raise TokenizerError(f"{file} is not a valid tokenizer.json: {exc}") from exc
    return _HFTokenizer(file, loaded)


def resolve_tokenizer(tokenizer: "Tokenizer | str | os.PathLike[str] | None") -> Tokenizer:
    """A tokenizer object from None (byte-level), a path (tokenizer.json) or a tokenizer itself."""
    if tokenizer is None:
        return ByteTokenizer()
    if isinstance(tokenizer, str | os.PathLike):
        return load_tokenizer(tokenizer)
    return tokenizer
