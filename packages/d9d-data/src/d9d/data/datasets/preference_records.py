"""One preference record (`{"prompt", "chosen", "rejected"}`) checked and tokenized as TRL 1.16 does.

TRL's `DPOTrainer._prepare_dataset`: plain text gets the tokenizer's EOS text appended to chosen and
rejected (unless they end with it) and is tokenized with the tokenizer's own special tokens
(`tokenizer(text)`); conversations go through the chat template, the prompt with the generation
prompt, prompt + completion without. The completion starts where the tokenized prompt and both
tokenized prompt + completion sequences stop agreeing (their common prefix), so a sequence is its
prompt + completion ids, and the prompt length is shared by chosen and rejected.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from d9d.data.datasets.sft import check_message_shapes
from d9d.data.datasets.tokenizer import ChatTokenizer, Tokenizer
from d9d.data.errors import DatasetError, TokenizerError

__all__ = ["EncodedPair", "PairFormat", "encode_pair", "pair_format"]

#: "plain": the fields are strings; "chat": lists of {role, content} messages.
PairFormat = Literal["plain", "chat"]

_FIELDS = ("prompt", "chosen", "rejected")


@runtime_checkable
class _KnowsSpecialTokens(Protocol):
    """A tokenizer with named special-token texts and its own special tokens (a Hugging Face folder)."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """{"eos_token": "<|im_end|>", ...}."""
        ...

    def encode_with_special_tokens(self, text: str) -> np.ndarray:
        """Ids of `text` with the special tokens the tokenizer adds itself (BOS, ...)."""
        ...


@dataclass(frozen=True)
class EncodedPair:
    """A pair as token ids: prompt + chosen and prompt + rejected, and the length of their shared prompt."""

    chosen: np.ndarray
    rejected: np.ndarray
    prompt_len: int


def pair_format(record: dict[str, Any], where: str) -> PairFormat:
    """Whether `record` is a plain-text or a conversational pair (checking its three fields are there)."""
    missing = [name for name in _FIELDS if name not in record]
    if missing:
        raise DatasetError(
            f"{where}: missing {', '.join(repr(m) for m in missing)}; a preference record needs "
            f"'prompt', 'chosen' and 'rejected' (got keys {sorted(record)})"
        )
    return "chat" if isinstance(record["prompt"], list) else "plain"


def encode_pair(record: dict[str, Any], form: PairFormat, tokenizer: Tokenizer, where: str) -> EncodedPair:
    """Token ids of one pair in the dataset's format `form` (TRL's tokenization, see the module).

    Raises:
        DatasetError: a field of the wrong type, an empty completion, a chosen or rejected that is not a
            list of assistant messages, or a template that fails; the message starts with `where`.
    """
    if pair_format(record, where) != form:
        other = "conversational (message lists)" if form == "plain" else "plain text"
        raise DatasetError(
            f"{where}: this record is {other} but the dataset's first record is not; use one format "
            "(all plain text or all message lists) per dataset"
        )
    try:
        if form == "plain":
            prompt, full = _plain_ids(record, tokenizer, where)
        else:
            prompt, full = _chat_ids(record, tokenizer, where)
    except TokenizerError as exc:
        raise DatasetError(f"{where}: {exc}") from exc
    prompt_len = min(_common_prefix(prompt, full[0]), _common_prefix(prompt, full[1]))
    for name, ids in zip(("chosen", "rejected"), full, strict=True):
        if len(ids) <= prompt_len:
            raise DatasetError(
                f"{where}: '{name}' adds no token after the prompt; give it a non-empty completion"
            )
    return EncodedPair(chosen=full[0], rejected=full[1], prompt_len=prompt_len)


def _plain_ids(
    record: dict[str, Any], tokenizer: Tokenizer, where: str
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Prompt ids and prompt + chosen / prompt + rejected ids of a plain-text pair."""
    for name in _FIELDS:
        if not isinstance(record[name], str):
            raise DatasetError(
                f"{where}: '{name}' must be a string like 'prompt' (plain text), got {type(record[name]).__name__}"
            )
        if name != "prompt" and not record[name].strip():
            raise DatasetError(
                f"{where}: '{name}' is empty; every pair needs a non-empty chosen and rejected text"
            )
    special = isinstance(tokenizer, _KnowsSpecialTokens)
    eos_text = tokenizer.special_tokens.get("eos_token") if special else None
    encode = tokenizer.encode_with_special_tokens if special else tokenizer.encode
    prompt = np.asarray(encode(record["prompt"]), dtype=np.int64)
    full = []
    for name in ("chosen", "rejected"):
        completion = record[name]
        if eos_text is not None:  # TRL appends the EOS text, then tokenizes
            if not completion.endswith(eos_text):
                completion += eos_text
            full.append(np.asarray(encode(record["prompt"] + completion), dtype=np.int64))
        else:  # a tokenizer without EOS text (the byte tokenizer): the EOS id
            ids = np.asarray(encode(record["prompt"] + completion), dtype=np.int64)
            eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
            full.append(np.concatenate([ids, np.asarray(eos, dtype=np.int64)]))
    return prompt, (full[0], full[1])


def _chat_ids(
    record: dict[str, Any], tokenizer: Tokenizer, where: str
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Prompt ids and prompt + chosen / prompt + rejected ids of a conversational pair."""
    if not isinstance(tokenizer, ChatTokenizer) or tokenizer.chat_template is None:
        raise DatasetError(
            f"{where}: conversational pairs need a tokenizer with a chat template (a Hugging Face tokenizer "
            f"folder whose tokenizer_config.json has chat_template), but {tokenizer.name} has none"
        )
    prompt = _messages(record["prompt"], "prompt", where, assistant_only=False)
    chosen = _messages(record["chosen"], "chosen", where, assistant_only=True)
    rejected = _messages(record["rejected"], "rejected", where, assistant_only=True)
    prompt_ids = np.asarray(tokenizer.apply_chat_template(prompt, add_generation_prompt=True), dtype=np.int64)
    full = tuple(
        np.asarray(tokenizer.apply_chat_template(prompt + c), dtype=np.int64) for c in (chosen, rejected)
    )
    return prompt_ids, (full[0], full[1])


def _messages(value: Any, name: str, where: str, *, assistant_only: bool) -> list[dict[str, Any]]:
    """`value` checked to be a non-empty list of {role, content} messages (assistant ones for a completion)."""
    kind = "assistant messages" if assistant_only else "messages"
    if not isinstance(value, list) or not value:
        raise DatasetError(
            f"{where}: '{name}' must be a non-empty list of {kind} like 'prompt' (conversational), got {value!r}"
        )
    check_message_shapes(value, where, name)
    for i, message in enumerate(value):
        if assistant_only and message["role"] != "assistant":
            raise DatasetError(
                f"{where}: '{name}' message {i} has role {message['role']!r}; chosen and rejected hold only "
                "the assistant's answer (role 'assistant'); move the other turns into 'prompt'"
            )
        if assistant_only and not message["content"].strip():
            raise DatasetError(f"{where}: '{name}' message {i} is empty; every pair needs a non-empty answer")
    return value


def _common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Number of leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
