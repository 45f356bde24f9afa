"""`PreferenceDataset`: prompt / chosen / rejected pairs (TRL's preference format) for DPO-style losses."""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import torch

from d9d.data.datasets.packed import IGNORE_INDEX, sample_index
from d9d.data.datasets.preference_records import PairFormat, encode_pair, pair_format
from d9d.data.datasets.sft import _read_records, find_jsonl_files
from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError
from d9d.data.packing import PADDING_DOCUMENT_ID

__all__ = ["PreferenceDataset", "PreferenceStats", "collate_preference"]

Overflow = Literal["truncate", "drop"]


class PreferenceStats(msgspec.Struct, frozen=True, kw_only=True):
    """What building a `PreferenceDataset` did to the records it read (for the log)."""

    records: int
    """Records (JSONL lines that are not blank) read."""
    pairs: int
    """Pairs kept."""
    truncated: int
    """Kept pairs with a sequence cut to fit (overflow="truncate")."""
    dropped_too_long: int
    """Pairs that did not fit, left out (overflow="drop")."""
    tokens: int
    """Tokens of the kept sequences (prompt + completion, twice per pair)."""
    label_tokens: int
    """Of those, the completion tokens the loss reads."""

    def __str__(self) -> str:
        return (
            f"{self.pairs} of {self.records} preference pairs kept ({self.truncated} truncated, "
            f"{self.dropped_too_long} too long dropped), {self.tokens} tokens, {self.label_tokens} trained on"
        )


def collate_preference(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Items of a `PreferenceDataset` as one microbatch: rows concatenated, sequence ids renumbered.

    Each item's sequence ids (>= 0) move up by twice the pairs of the items before it, so pair k of the
    batch keeps 2k (chosen) and 2k + 1 (rejected); `pair_ids` (and `reference_logps`, when the items
    carry them) are concatenated in the same order.
    """
    if not items:
        raise DatasetError("collate_preference got no items; a microbatch needs at least one")
    shifted, before = [], 0
    for item in items:
        ids = item["sequence_ids"]
        shifted.append(torch.where(ids >= 0, ids + 2 * before, ids))
        before += len(item["pair_ids"])
    batch = {key: torch.cat([item[key] for item in items]) for key in items[0] if key != "sequence_ids"}
    batch["sequence_ids"] = torch.cat(shifted)
    return batch


class PreferenceDataset:
    """Preference pairs from JSONL in TRL's standard format, tokenized as TRL 1.16 tokenizes them.

    A line is `{"prompt": str, "chosen": str, "rejected": str}` (plain text: the tokenizer's EOS is
    appended to chosen and rejected) or `{"prompt": [messages], "chosen": [assistant messages],
    "rejected": [assistant messages]}` (through the tokenizer's chat template). A sequence is prompt
    ids, then completion ids, then EOS; the completion starts at the common prefix of the tokenized
    prompt and both tokenized prompt + completion sequences, as in TRL's `DPOTrainer`.

    Every item and every collated batch (`collate_preference`) is a dict of int64 tensors:

    - `input_ids` [R, S]: whole sequences, right-padded with the pad id (the tokenizer's pad token, else
      EOS); S = seq_len.
    - `labels` [R, S], already shifted: `labels[r, t] = input_ids[r, t + 1]` when token t + 1 is a
      completion token, else `IGNORE_INDEX` (prompt and padding are never labelled).
    - `sequence_ids` [R, S]: at each labelled position the completion sequence it belongs to within
      the batch (pair k's chosen is 2k, its rejected 2k + 1), -1 where the label is IGNORE_INDEX.
    - `pair_ids` [P]: the index (among the kept pairs, `num_pairs`) of each of the batch's P pairs, in k order.
    - with `pack=True` also `position_ids` and `document_ids` [R, S] as `SFTDataset`'s packed rows:
      prompt + chosen and prompt + rejected are two documents (document id = the sequence's index in
      its row), positions restart at 0 in each, padding has document id -1.
    - once `reference_logps` is set (by the preference task's reference pass), `reference_logps`
      [P, 2] float64: the pairs' chosen and rejected log-probabilities under the reference policy.

    Without packing one item is one pair in 2 rows (chosen, then rejected). With `pack=True` one item is
    one row holding whole pairs, filled greedily in file order; a pair never spans two rows.

    Overflow: a sequence longer than seq_len (packed: a pair longer than seq_len, both sequences
    together) is cut to keep its start ("truncate", TRL's `keep_start` with `max_length=seq_len`;
    packed, the longer sequence is cut first, then both evenly) or the pair is dropped ("drop").

    Args:
        sources: a .jsonl file, a folder (its *.jsonl files, sorted) or a list of them.
        seq_len: tokens per row.
        tokenizer: a tokenizer folder / tokenizer.json path, a `Tokenizer`, or None (byte-level, plain
            text only).
        overflow: "truncate" or "drop" pairs that do not fit.
        pack: several pairs per row (see above).

    Raises:
        DatasetError: a bad record, with its file:line: a missing field, an empty completion, a prompt
            that leaves no completion token within seq_len, plain and conversational records mixed, a
            chosen/rejected that is not a list of assistant messages.
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        seq_len: int,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        overflow: Overflow = "truncate",
        pack: bool = False,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
            raise DatasetError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if overflow not in ("truncate", "drop"):
            raise DatasetError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
        self._seq_len = seq_len
        self._pack = bool(pack)
        self._reference: torch.Tensor | None = None
        self._files = find_jsonl_files(sources)
        self._tokenizer = resolve_tokenizer(tokenizer)
        pad = getattr(self._tokenizer, "pad_id", None)
        self._pad_id = int(pad if pad is not None else self._tokenizer.eos_id or 0)

        sequences: list[np.ndarray] = []
        prompt_lens: list[int] = []
        records = truncated = too_long = 0
        form: PairFormat | None = None
        for file, line_no, record in _read_records(self._files):
            records += 1
            where = f"{file}:{line_no}"
            form = form or pair_format(record, where)
            pair = encode_pair(record, form, self._tokenizer, where)
            caps = _caps(len(pair.chosen), len(pair.rejected), seq_len, self._pack)
            if pair.prompt_len >= min(caps):
                raise DatasetError(
                    f"{where}: the prompt is {pair.prompt_len} tokens, which leaves no completion token in "
                    f"seq_len={seq_len}{' (packed: both sequences of a pair share a row)' if self._pack else ''}; "
                    "raise seq_len or shorten the prompt"
                )
            cut = caps != (len(pair.chosen), len(pair.rejected))
            if cut and overflow == "drop":
                too_long += 1
                continue
            truncated += cut
            sequences += [pair.chosen[: caps[0]], pair.rejected[: caps[1]]]
            prompt_lens.append(pair.prompt_len)
        if not prompt_lens:
            raise DatasetError(
                f"no pair left in {[str(f) for f in self._files]} ({records} records, {too_long} too long); "
                "raise seq_len, use overflow='truncate' or check the data"
            )
        lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._ids = np.concatenate(sequences).astype(np.int64)
        self._prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
        self._completion_tokens = (lengths.reshape(-1, 2) - self._prompt_lens[:, None]).astype(np.int64)
        self._row_starts = _greedy_rows(lengths.reshape(-1, 2).sum(1), seq_len) if self._pack else None
        self._stats = PreferenceStats(
            records=records,
            pairs=len(prompt_lens),
            truncated=truncated,
            dropped_too_long=too_long,
            tokens=int(lengths.sum()),
            label_tokens=int(self._completion_tokens.sum()),
        )

    @property
    def seq_len(self) -> int:
        """Tokens per row."""
        return self._seq_len

    @property
    def document_masking(self) -> bool:
        """Whether rows carry `position_ids` and `document_ids`: packed rows do (`pack=True`)."""
        return self._pack

    @property
    def stats(self) -> PreferenceStats:
        """Records read, pairs kept, truncated and dropped, and token counts (`str()` gives one log line)."""
        return self._stats

    @property
    def num_pairs(self) -> int:
        """Kept pairs; equals `len()` without packing."""
        return len(self._prompt_lens)

    @property
    def completion_tokens(self) -> np.ndarray:
        """int64 [num_pairs, 2]: labelled (completion) tokens of each pair's chosen and rejected sequence."""
        return self._completion_tokens.copy()

    @property
    def rows_per_item(self) -> int:
        """Rows of one item: 2 (chosen, rejected) without packing, 1 packed."""
        return 1 if self._pack else 2

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / token slots over all rows (1.0 = no padding)."""
        return self._stats.tokens / (len(self) * self.rows_per_item * self._seq_len)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        return self._tokenizer.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the pairs were encoded with."""
        return self._tokenizer

    @property
    def files(self) -> list[Path]:
        """The JSONL files, in the order they were read."""
        return list(self._files)

    collate = staticmethod(collate_preference)
    """`collate_preference`: the collate_fn for this dataset's items."""

    def __len__(self) -> int:
        if self._row_starts is not None:
            return len(self._row_starts) - 1
        return self.num_pairs

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Item `index`: one pair in 2 rows, or (packed) one row of whole pairs; see the class docstring."""
        index = sample_index(index, len(self))
        if self._row_starts is None:
            pairs = np.asarray([index])
        else:
            pairs = np.arange(self._row_starts[index], self._row_starts[index + 1])
        rows, size = self.rows_per_item, self._seq_len
        input_ids = np.full((rows, size), self._pad_id, dtype=np.int64)
        labels = np.full((rows, size), IGNORE_INDEX, dtype=np.int64)
        sequence_ids = np.full((rows, size), -1, dtype=np.int64)
        position_ids = np.zeros((rows, size), dtype=np.int64)
        document_ids = np.full((rows, size), PADDING_DOCUMENT_ID, dtype=np.int64)
        at = 0
        for k, pair in enumerate(pairs):
            for side in (0, 1):
                sequence = 2 * k + side
                row = 0 if self._pack else side
                ids = self._ids[self._offsets[2 * pair + side] : self._offsets[2 * pair + side + 1]]
                start, n = (at if self._pack else 0), len(ids)
                first = start + int(self._prompt_lens[pair]) - 1  # predicts the first completion token
                input_ids[row, start : start + n] = ids
                labels[row, first : start + n - 1] = ids[first - start + 1 :]
                sequence_ids[row, first : start + n - 1] = sequence
                position_ids[row, start : start + n] = np.arange(n)
                document_ids[row, start : start + n] = sequence
                at = start + n
        item = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "sequence_ids": torch.from_numpy(sequence_ids),
            "pair_ids": torch.from_numpy(pairs.astype(np.int64)),
        }
        if self._pack:
            position_ids[0, at:] = np.arange(size - at)
            item["position_ids"] = torch.from_numpy(position_ids)
            item["document_ids"] = torch.from_numpy(document_ids)
        if self._reference is not None:
            item["reference_logps"] = self._reference[item["pair_ids"]]
        return item

    @property
    def reference_logps(self) -> torch.Tensor | None:
        """float64 [num_pairs, 2]: each pair's chosen and rejected log-probabilities under the reference
        policy, once a task has computed them (`d9d.trainer:PreferenceTask`); every item then carries its
        pairs' rows as `reference_logps` [pairs, 2]. None before."""
        return self._reference

    @reference_logps.setter
    def reference_logps(self, table: torch.Tensor | None) -> None:
        if table is not None and tuple(table.shape) != (self.num_pairs, 2):
            raise DatasetError(
                f"reference_logps must be [num_pairs, 2] = [{self.num_pairs}, 2], got {list(table.shape)}: "
                "they were computed for other data"
            )
        self._reference = None if table is None else table.detach().to("cpu", torch.float64)

    def __repr__(self) -> str:
        packed = f", packed {self.packing_efficiency:.1%}" if self._pack else ""
        return f"PreferenceDataset({len(self._files)} files, seq_len={self._seq_len}, pairs={self.num_pairs}{packed})"


def _caps(chosen: int, rejected: int, seq_len: int, pack: bool) -> tuple[int, int]:
    """Lengths the two sequences keep: each at most seq_len; packed, both together at most seq_len
    (the longer is cut first, down to the shorter; then both evenly, chosen keeping the odd token)."""
    if not pack:
        return min(chosen, seq_len), min(rejected, seq_len)
    if chosen + rejected <= seq_len:
        return chosen, rejected
    shorter = min(chosen, rejected)
    if 2 * shorter <= seq_len:
        rest = seq_len - shorter
        return (shorter, rest) if chosen == shorter else (rest, shorter)
    return (seq_len + 1) // 2, seq_len // 2


def _greedy_rows(pair_lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries of pairs packed greedily in order: row i holds pairs [starts[i], starts[i + 1])."""
    starts, used = [0], 0
    for i, length in enumerate(pair_lengths.tolist()):
        if used + length > seq_len:
            starts.append(i)
            used = 0
        used += length
    starts.append(len(pair_lengths))
    return np.asarray(starts, dtype=np.int64)
