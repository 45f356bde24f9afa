"""Fixed-length causal-LM samples cut from one flat sequence of token ids, and the text files behind it."""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from d9d.data.errors import DatasetError

__all__ = ["CausalLMSample", "PackedTokens", "find_text_files", "token_dtype"]

#: One sample: `input_ids` and `labels` (the same tokens shifted by one), both int64 of length seq_len.
CausalLMSample = dict[str, torch.Tensor]

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class PackedTokens:
    """Base of the token datasets: sample i holds tokens [i·L, i·L + L] as inputs and shifted labels.

    Consecutive samples share one boundary token (sample i's last label is sample i+1's first input),
    so no token is wasted and every token but the first is a label exactly once.
    """

    def __init__(self, seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DatasetError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        self._seq_len = seq_len

    @property
    def seq_len(self) -> int:
        """Tokens per sample."""
        return self._seq_len

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
        """Sample `index`: {"input_ids": int64[seq_len], "labels": int64[seq_len]}."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} out of range for a dataset of {n} samples")
        start = index * self._seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self._seq_len + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def _check_enough_tokens(self, where: str) -> None:
        if self.num_tokens < self._seq_len + 1:
            raise DatasetError(
                f"{where} holds {self.num_tokens} tokens, too few for one sample of seq_len={self._seq_len} "
                f"(needs {self._seq_len + 1}); add text or lower seq_len"
            )


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


def find_text_files(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Text files named by `sources`: files as given, folders expanded to their *.txt files (sorted)."""
    items = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise DatasetError(
                    f"the folder {path} holds no *.txt files; name text files or another folder"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DatasetError(f"no text file or folder at {path}; check the path")
    if not files:
        raise DatasetError("no text sources were given; pass a text file, a folder of *.txt files or a list")
    return files
