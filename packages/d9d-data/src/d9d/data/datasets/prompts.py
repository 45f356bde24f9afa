"""`PromptDataset`: prompts for reinforcement learning with rollouts (GRPO), one per JSONL line, with
whatever else the line holds kept whole for the reward function (e.g. the expected answer)."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from d9d.data.datasets.packed import sample_index
from d9d.data.datasets.sft import _read_records, find_jsonl_files
from d9d.data.datasets.tokenizer import ChatTokenizer, Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError

__all__ = ["PromptDataset", "collate_prompts"]


def collate_prompts(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Items of a `PromptDataset` as one microbatch: `prompt_ids` [B, longest] right-padded with 0,
    `prompt_lengths` [B], `index` [B] (each prompt's index in the dataset)."""
    if not items:
        raise DatasetError("collate_prompts got no items; a microbatch needs at least one")
    lengths = torch.tensor([item["prompt_ids"].numel() for item in items], dtype=torch.long)
    ids = torch.zeros(len(items), int(lengths.max()), dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : item["prompt_ids"].numel()] = item["prompt_ids"]
    return {
        "prompt_ids": ids,
        "prompt_lengths": lengths,
        "index": torch.cat([item["index"] for item in items]),
    }


class PromptDataset:
    """Prompts from JSONL: `{"prompt": str, ...}` (plain text, tokenized without special tokens, as
    TRL's GRPOTrainer does) or `{"prompt": [messages], ...}` (through the tokenizer's chat template,
    with the generation prompt). The other fields of a line are kept as they are: `record(i)` gives
    them to the reward function, as TRL passes a dataset's columns.

    An item is `{"prompt_ids": [length], "index": [1]}`; `collate_prompts` pads a microbatch of them.

    Args:
        sources: a .jsonl file, a folder (its *.jsonl files, sorted) or a list of them.
        max_prompt_len: the most tokens a prompt may have (the sequence budget left for it).
        tokenizer: a tokenizer folder / tokenizer.json, a `Tokenizer`, or None (bytes).

    Raises:
        DatasetError: with its file:line, a line without a prompt, an empty prompt, chat messages
            without a chat template, or a prompt longer than `max_prompt_len`.
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        max_prompt_len: int,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, int) or max_prompt_len < 1:
            raise DatasetError(f"max_prompt_len must be an integer >= 1, got {max_prompt_len!r}")
        self._files = find_jsonl_files(sources)
        self._tokenizer = resolve_tokenizer(tokenizer)
        self._max = max_prompt_len
        self._records: list[dict[str, Any]] = []
        self._ids: list[np.ndarray] = []
        for file, line_no, record in _read_records(self._files):
            ids = self._encode(record, f"{file}:{line_no}")
            self._records.append(record)
            self._ids.append(ids)
        if not self._ids:
            raise DatasetError(f"no prompt in {[str(f) for f in self._files]}; check the path")

    def _encode(self, record: dict[str, Any], where: str) -> np.ndarray:
        prompt = record.get("prompt")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DatasetError(f"{where}: 'prompt' is empty; every line needs a prompt to complete")
            ids = np.asarray(self._tokenizer.encode(prompt), dtype=np.int64)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            tokenizer = self._tokenizer
            if not isinstance(tokenizer, ChatTokenizer) or tokenizer.chat_template is None:
                raise DatasetError(
                    f"{where}: chat-message prompts need a tokenizer with a chat template (a Hugging Face "
                    f"tokenizer folder whose tokenizer_config.json has chat_template), but {tokenizer.name} has none"
                )
            ids = np.asarray(
                tokenizer.apply_chat_template(prompt, add_generation_prompt=True), dtype=np.int64
            )
        else:
            raise DatasetError(
                f"{where}: each line needs 'prompt': a string or a list of chat messages, got "
                f"{type(prompt).__name__ if prompt is not None else 'none'}"
            )
        if len(ids) > self._max:
            raise DatasetError(
                f"{where}: the prompt is {len(ids)} tokens, more than max_prompt_len={self._max}; raise "
                "max_prompt_len (the sequence budget less the completion's) or shorten the prompt"
            )
        return ids

    @property
    def max_prompt_len(self) -> int:
        """The most tokens a prompt may have."""
        return self._max

    @property
    def num_prompts(self) -> int:
        """Prompts (lines); equals `len()`."""
        return len(self._ids)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the prompts were encoded with (the completions are decoded with it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        return self._tokenizer.vocab_size

    @property
    def files(self) -> list[Path]:
        """The JSONL files, in the order they were read."""
        return list(self._files)

    def record(self, index: int) -> dict[str, Any]:
        """Line `index` as it was read (the prompt and every other field)."""
        return self._records[sample_index(index, len(self))]

    def prompt_text(self, index: int) -> str:
        """The prompt of line `index` as the model sees it (decoded from its tokens)."""
        return self._tokenizer.decode(self._ids[sample_index(index, len(self))])

    collate = staticmethod(collate_prompts)
    """`collate_prompts`: the collate_fn for this dataset's items."""

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = sample_index(index, len(self))
        return {"prompt_ids": torch.from_numpy(self._ids[index]), "index": torch.tensor([index])}

    def __repr__(self) -> str:
        return f"PromptDataset({len(self._files)} files, prompts={len(self)}, max_prompt_len={self._max})"
