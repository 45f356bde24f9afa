"""`TextDataset`: local text files tokenized in memory and packed into fixed-length causal-LM samples."""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from d9d.data.datasets.packed import PackedTokens, find_text_files, token_dtype
from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer

__all__ = ["TextDataset"]


class TextDataset(PackedTokens):
    """Fixed-length causal-LM samples from local text files, tokenized once when it is built.

    Each file is one document; documents are joined with the tokenizer's end-of-document token and
    the joined sequence is cut like a token file (see `TokenFileDataset`). Meant for corpora that fit
    in memory; for larger ones, tokenize once with `write_token_file` and use `TokenFileDataset`.

    Args:
        sources: a text file, a folder (its *.txt files, sorted) or a list of them.
        seq_len: tokens per sample.
        tokenizer: None for the built-in byte-level tokenizer, a local tokenizer.json path (needs the
            optional `tokenizers` package), or any `Tokenizer`.
        document_masking: add `position_ids` and `document_ids` to every sample (see `PackedTokens`).
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        seq_len: int,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        document_masking: bool = False,
    ) -> None:
        super().__init__(seq_len, document_masking=document_masking)
        self._files = find_text_files(sources)
        self._tokenizer = resolve_tokenizer(tokenizer)
        dtype = token_dtype(None, self._tokenizer.vocab_size)
        eos = self._tokenizer.eos_id
        pieces: list[np.ndarray] = []
        for file in self._files:
            pieces.append(
                np.asarray(self._tokenizer.encode(file.read_text(encoding="utf-8", errors="replace")))
            )
            if eos is not None:
                pieces.append(np.asarray([eos]))
        self._tokens = np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype=dtype)
        self._check_enough_tokens(f"the text in {[str(f) for f in self._files]}")
        self._check_document_masking(f"the tokenizer {self._tokenizer.name}")

    @property
    def tokens(self) -> np.ndarray:
        """All token ids, documents joined by the end-of-document token."""
        return self._tokens

    @property
    def eos_id(self) -> int | None:
        """The tokenizer's end-of-document token, which joins the files."""
        return self._tokenizer.eos_id

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        return self._tokenizer.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the text was encoded with (use it to decode samples)."""
        return self._tokenizer

    @property
    def files(self) -> list[Path]:
        """The text files, in the order they were joined."""
        return list(self._files)

    def __repr__(self) -> str:
        return f"TextDataset({len(self._files)} files, seq_len={self.seq_len}, samples={len(self)})"
