"""`SFTDataset`: chat or prompt/completion JSONL tokenized once, labels only on what the model should say."""

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import torch

from d9d.data.datasets.packed import IGNORE_INDEX, CausalLMSample, find_files, sample_index
from d9d.data.datasets.tokenizer import ChatTokenizer, Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError, TokenizerError
from d9d.data.packing import PADDING_DOCUMENT_ID, pack_lengths

__all__ = ["SFTDataset", "SFTStats", "find_jsonl_files"]

TrainOn = Literal["assistant", "all"]
Overflow = Literal["truncate", "drop"]


class SFTStats(msgspec.Struct, frozen=True, kw_only=True):
    """What building an `SFTDataset` did to the records it read (for the log)."""

    records: int
    """Records (JSONL lines that are not blank) read."""
    samples: int
    """Samples kept."""
    truncated: int
    """Kept samples cut to seq_len (overflow="truncate")."""
    dropped_too_long: int
    """Samples longer than seq_len left out (overflow="drop")."""
    dropped_without_labels: int
    """Samples left out because no token was left to train on (no assistant turn, or cut before it)."""
    tokens: int
    """Input tokens of the kept samples."""
    label_tokens: int
    """Of those, the ones whose label is not IGNORE_INDEX."""

    def __str__(self) -> str:
        return (
            f"{self.samples} of {self.records} records kept ({self.truncated} truncated, "
            f"{self.dropped_too_long} too long dropped, {self.dropped_without_labels} without labels dropped), "
            f"{self.tokens} tokens, {self.label_tokens} trained on"
        )


#: The message roles a conversation may use by default (chat templates know these).
DEFAULT_ROLES = ("system", "user", "assistant", "tool")


class SFTDataset:
    """Supervised fine-tuning samples from JSONL: one conversation or prompt/completion pair per line.

    A line is `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}`
    (rendered with the tokenizer's chat template; needs a `ChatTokenizer`, e.g. a Hugging Face
    tokenizer folder) or `{"prompt": "...", "completion": "..."}` (plain text: BOS if the tokenizer has
    one, prompt, completion, EOS; any `Tokenizer`). Samples are shifted like `PackedTokens`: `labels[t]`
    is the token after `input_ids[t]`, and it is `IGNORE_INDEX` unless that token is trained on.

    Without packing each sample is one record padded to `seq_len` (`input_ids` with the pad token,
    `labels` with IGNORE_INDEX). With `pack=True` records are packed into rows of `seq_len` tokens
    (best-fit decreasing) that also carry `position_ids` (restarting at 0 per record) and
    `document_ids` (0, 1, ... per record, -1 for padding): the model must use them
    (`d9d.data.block_causal_mask`) or it attends across records.

    Args:
        sources: a .jsonl file, a folder (its *.jsonl files, sorted) or a list of them.
        seq_len: tokens per sample (input length; a record of n tokens gives n − 1 inputs).
        tokenizer: a tokenizer folder / tokenizer.json path, a `Tokenizer`, or None (byte-level, for
            prompt/completion only).
        train_on: "assistant" (labels on assistant turns / the completion, including the template's
            end-of-turn tokens) or "all" (every token).
        overflow: "truncate" (keep the first seq_len + 1 tokens) or "drop" records that do not fit.
        pack: pack several records per row (see above).
        roles: the message roles a conversation may use; any other is refused with its file and line
            (a template renders an unknown role silently, so a typo would train as it stands).
    """

    def __init__(
        self,
        sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        seq_len: int,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        train_on: TrainOn = "assistant",
        overflow: Overflow = "truncate",
        pack: bool = False,
        roles: Sequence[str] = DEFAULT_ROLES,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DatasetError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        if train_on not in ("assistant", "all"):
            raise DatasetError(f"train_on must be 'assistant' or 'all', got {train_on!r}")
        if overflow not in ("truncate", "drop"):
            raise DatasetError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
        self._seq_len = seq_len
        self._train_on = train_on
        self._pack = bool(pack)
        self._roles = tuple(roles)
        self._files = find_jsonl_files(sources)
        self._tokenizer = resolve_tokenizer(tokenizer)
        pad = getattr(self._tokenizer, "pad_id", None)
        self._pad_id = int(pad if pad is not None else self._tokenizer.eos_id or 0)

        inputs: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        records = truncated = too_long = without_labels = 0
        for file, line_no, record in _read_records(self._files):
            records += 1
            ids, trained = self._encode(record, file, line_no)
            cut = len(ids) > seq_len + 1
            if cut:
                if overflow == "drop":
                    too_long += 1
                    continue
                ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
            target = np.where(trained[1:], ids[1:], IGNORE_INDEX)
            if not (target != IGNORE_INDEX).any():
                without_labels += 1
                continue
            truncated += cut
            inputs.append(ids[:-1])
            labels.append(target)
        if not inputs:
            raise DatasetError(
                f"no sample left in {[str(f) for f in self._files]} ({records} records: {too_long} too long, "
                f"{without_labels} without tokens to train on); raise seq_len or check the data"
            )
        lengths = np.asarray([len(x) for x in inputs], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        # int32 halves the memory of int64 and holds any vocabulary and IGNORE_INDEX.
        self._inputs = np.concatenate(inputs).astype(np.int32)
        self._labels = np.concatenate(labels).astype(np.int32)
        self._rows = _flatten_rows(pack_lengths(lengths, seq_len)) if self._pack else None
        self._stats = SFTStats(
            records=records,
            samples=len(inputs),
            truncated=truncated,
            dropped_too_long=too_long,
            dropped_without_labels=without_labels,
            tokens=int(lengths.sum()),
            label_tokens=int((self._labels != IGNORE_INDEX).sum()),
        )

    @property
    def seq_len(self) -> int:
        """Tokens per sample."""
        return self._seq_len

    @property
    def document_masking(self) -> bool:
        """Whether rows carry `position_ids` and `document_ids`: packed rows do (`pack=True`)."""
        return self._pack

    @property
    def stats(self) -> SFTStats:
        """Records read, kept, truncated and dropped, and token counts (`str()` gives one log line)."""
        return self._stats

    @property
    def num_records(self) -> int:
        """Kept records (conversations or prompt/completion pairs); equals `len()` without packing."""
        return len(self._offsets) - 1

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / token slots over all samples (1.0 = no padding)."""
        return self._stats.tokens / (len(self) * self._seq_len)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size."""
        return self._tokenizer.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the records were encoded with."""
        return self._tokenizer

    @property
    def files(self) -> list[Path]:
        """The JSONL files, in the order they were read."""
        return list(self._files)

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows[0]) - 1
        return self.num_records

    def __getitem__(self, index: int) -> CausalLMSample:
        """Sample `index`: `input_ids`, `labels` (int64[seq_len]); packed also `position_ids`, `document_ids`."""
        index = sample_index(index, len(self))
        records = (
            [index] if self._rows is None else self._rows[1][self._rows[0][index] : self._rows[0][index + 1]]
        )
        input_ids = np.full(self._seq_len, self._pad_id, dtype=np.int64)
        labels = np.full(self._seq_len, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros(self._seq_len, dtype=np.int64)
        document_ids = np.full(self._seq_len, PADDING_DOCUMENT_ID, dtype=np.int64)
        at = 0
        for doc, record in enumerate(records):
            start, end = self._offsets[record], self._offsets[record + 1]
            length = end - start
            input_ids[at : at + length] = self._inputs[start:end]
            labels[at : at + length] = self._labels[start:end]
            position_ids[at : at + length] = np.arange(length)
            document_ids[at : at + length] = doc
            at += length
        position_ids[at:] = np.arange(self._seq_len - at)
        sample = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}
        if self._rows is not None:
            sample["position_ids"] = torch.from_numpy(position_ids)
            sample["document_ids"] = torch.from_numpy(document_ids)
        return sample

    def _encode(self, record: dict[str, Any], file: Path, line_no: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of one record and which of them are trained on."""
        where = f"{file}:{line_no}"
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages:
                raise DatasetError(
                    f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
                )
            check_message_shapes(messages, where)
            for i, message in enumerate(messages):
                if message["role"] not in self._roles:
                    raise DatasetError(
                        f"{where}: message {i} has role {message['role']!r}; the roles accepted are "
                        f"{', '.join(self._roles)} (pass more with SFTDataset(roles=...), e.g. the dataset "
                        "section's roles)"
                    )
            if not isinstance(self._tokenizer, ChatTokenizer) or self._tokenizer.chat_template is None:
                raise DatasetError(
                    f"{where}: chat messages need a tokenizer with a chat template (a Hugging Face tokenizer "
                    f"folder whose tokenizer_config.json has chat_template), but {self._tokenizer.name} has none"
                )
            try:
                if self._train_on == "all":  # no need to find the assistant turns
                    ids = np.asarray(self._tokenizer.apply_chat_template(messages), dtype=np.int64)
                    return ids, np.ones(len(ids), dtype=bool)
                ids, assistant = self._tokenizer.encode_chat(messages)
            except TokenizerError as exc:
                raise DatasetError(f"{where}: {exc}") from exc
            return np.asarray(ids, dtype=np.int64), np.asarray(assistant, dtype=bool)
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DatasetError(
                f"{where}: a record needs 'messages' (a list) or string 'prompt' and 'completion', "
                f"got keys {sorted(record)}"
            )
        bos = getattr(self._tokenizer, "bos_id", None)
        eos = self._tokenizer.eos_id
        head = np.concatenate([[bos] if bos is not None else [], self._tokenizer.encode(prompt)])
        tail = np.concatenate([self._tokenizer.encode(completion), [eos] if eos is not None else []])
        ids = np.concatenate([head, tail]).astype(np.int64)
        trained = np.ones(len(ids), dtype=bool)
        if self._train_on == "assistant":
            trained[: len(head)] = False
        return ids, trained

    def __repr__(self) -> str:
        packed = f", packed {self.packing_efficiency:.1%}" if self._pack else ""
        return f"SFTDataset({len(self._files)} files, seq_len={self._seq_len}, samples={len(self)}{packed})"


def check_message_shapes(messages: list[Any], where: str, field: str | None = None) -> None:
    """Each of `messages` an object with string 'role' and 'content'.

    Raises:
        DatasetError: naming `where`, the field (when given) and the first message that is not.
    """
    label = f"'{field}' message" if field is not None else "message"
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: {label} {i} must be an object with string 'role' and 'content', got {message!r}"
            )


def find_jsonl_files(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """JSONL files named by `sources`: files as given, folders expanded to their *.jsonl files (sorted)."""
    return find_files(sources, ".jsonl", "JSONL")


def _read_records(files: list[Path]) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(file, 1-based line number, JSON object) of every non-blank line."""
    for file in files:
        with file.open("rb") as handle:
            for line_no, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise DatasetError(f"{file}:{line_no}: not UTF-8 text ({exc.reason})") from None
                except json.JSONDecodeError as exc:
                    raise DatasetError(
                        f"{file}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                if not isinstance(record, dict):
                    raise DatasetError(
                        f"{file}:{line_no}: a record must be a JSON object, got {type(record).__name__}"
                    )
                yield file, line_no, record


def _flatten_rows(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of record indices as (row offsets, record indices): two arrays instead of many lists."""
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return offsets, np.asarray([i for r in rows for i in r], dtype=np.int64)
