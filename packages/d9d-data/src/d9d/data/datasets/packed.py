"""Fixed-length causal-LM samples cut from one flat sequence of token ids, and the text files behind it."""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from d9d.data.errors import DatasetError
from d9d.data.packing import document_positions, eos_document_ids

__all__ = ["IGNORE_INDEX", "CausalLMSample", "PackedTokens", "find_text_files", "token_dtype"]

#: One sample: `input_ids` and `labels` (the same tokens shifted by one), both int64 of length seq_len;
#: with document masking also `position_ids` and `document_ids` (see `d9d.data.block_causal_mask`).
CausalLMSample = dict[str, torch.Tensor]

#: Label value that carries no loss (torch's cross-entropy default; d9d.trainer uses the same value).
IGNORE_INDEX = -100

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class PackedTokens:
    """Base of the token datasets: sample i holds tokens [i·L, i·L + L] as inputs and shifted labels.

    Consecutive samples share one boundary token (sample i's last label is sample i+1's first input),
    so no token is wasted and every token but the first is a label exactly once.

    With `document_masking`, each sample also holds `position_ids` (restarting at 0 after every
    end-of-document token) and `document_ids` (0, 1, ... per document in the window; an EOS belongs to
    the document it ends), so a model can build a block-causal mask (`d9d.data.block_causal_mask`)
    instead of attending across documents. The labels are unchanged: an EOS still predicts the first
    token of the next document.
    """

    def __init__(self, seq_len: int, *, document_masking: bool = False) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DatasetError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        self._seq_len = seq_len
        self._document_masking = bool(document_masking)

    @property
    def seq_len(self) -> int:
        """Tokens per sample."""
        return self._seq_len

    @property
    def document_masking(self) -> bool:
        """Whether samples carry `position_ids` and `document_ids` from the end-of-document tokens."""
        return self._document_masking

    @property
    def eos_id(self) -> int | None:
        """The end-of-document token that separates documents, None when unknown (overridden)."""
        return None

    @property
    def tokens(self) -> np.ndarray:
        """The flat token sequence (overridden by subclasses)."""
        raise NotImplementedError

    @property
    def num_tokens(self) -> int:
        """Length of the flat token sequence."""
        return len(self.tokens)

    @property
    def vocab_size(self) -> int | None:
        """Size of the vocabulary the ids come from (every id is below it), None when unknown.

        The trainer checks it against the model's input embedding before anything runs.
        """
        return None

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self._seq_len)

    def __getitem__(self, index: int) -> CausalLMSample:
        """Sample `index`: {"input_ids": int64[seq_len], "labels": int64[seq_len]} (+ document ids)."""
        index = sample_index(index, len(self))
        start = index * self._seq_len
        window = np.asarray(self.tokens[start : start + self._seq_len + 1], dtype=np.int64)
        tensor = torch.from_numpy(window)
        sample = {"input_ids": tensor[:-1], "labels": tensor[1:]}
        if self._document_masking:
            assert self.eos_id is not None  # checked when the dataset was built
            document_ids = eos_document_ids(window[:-1], self.eos_id)
            sample["position_ids"] = torch.from_numpy(document_positions(document_ids))
            sample["document_ids"] = torch.from_numpy(document_ids)
        return sample

    def _check_document_masking(self, where: str) -> None:
        if self._document_masking and self.eos_id is None:
            raise DatasetError(
                f"document_masking needs the end-of-document token id of {where}, which is unknown; use a "
                "tokenizer with an EOS token (or a token file whose sidecar records eos_id), or "
                "document_masking=False"
            )

    def _check_enough_tokens(self, where: str) -> None:
        if self.num_tokens < self._seq_len + 1:
            raise DatasetError(
                f"{where} holds {self.num_tokens} tokens, too few for one sample of seq_len={self._seq_len} "
                f"(needs {self._seq_len + 1}); add text or lower seq_len"
            )


def sample_index(index: int, n: int) -> int:
    """`index` of a dataset of `n` samples as a position in [0, n) (negative counts from the end).

    Raises:
        IndexError: out of range.
    """
    position = index + n if index < 0 else index
    if not 0 <= position < n:
        raise IndexError(f"sample {position} out of range for a dataset of {n} samples")
    return position


def token_dtype(name: str | None, vocab_size: int | None = None) -> np.dtype:
    """The numpy dtype of a token file: "uint16"/"uint32", or the smallest one that holds vocab_size."""
    if name is None:
        if vocab_size is None:
            raise DatasetError("the token dtype is unknown; pass dtype='uint16' or dtype='uint32'")
        name = "uint16" if vocab_size <= 2**16 else "uint32"
    if name not in _DTYPES:
        raise DatasetError(f"token dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    dtype = np.dtype(_DTYPES[name])
    if vocab_size is not None and vocab_size > np.iinfo(dtype).max + 1:
        raise DatasetError(f"a vocabulary of {vocab_size} tokens does not fit {name}; use dtype='uint32'")
    return dtype


def find_files(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], suffix: str, kind: str
) -> list[Path]:
    """Files named by `sources`: files as given, folders expanded to their `*<suffix>` files (sorted).

    `kind` names them in errors ("text", "JSONL").
    """
    items = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
            if not found:
                raise DatasetError(
                    f"the folder {path} holds no *{suffix} files; name {kind} files or another folder"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DatasetError(f"no {kind} file or folder at {path}; check the path")
    if not files:
        raise DatasetError(
            f"no {kind} sources were given; pass a {kind} file, a folder of *{suffix} files or a list"
        )
    return files


def find_text_files(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Text files named by `sources`: files as given, folders expanded to their *.txt files (sorted)."""
    return find_files(sources, ".txt", "text")
