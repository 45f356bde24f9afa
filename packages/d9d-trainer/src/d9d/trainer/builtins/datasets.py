"""The built-in dataset providers: conversations for supervised fine-tuning (`d9d.trainer:ChatDatasetProvider`),
preference pairs for DPO (`d9d.trainer:PreferenceDatasetProvider`) and plain text for pre-training
(`d9d.trainer:TextDatasetProvider`); prepared folders are
`d9d.trainer:PreparedDataProvider`'s. Paths are relative to the config file, like every path of a job.

    providers: {dataset: d9d.trainer:ChatDatasetProvider}
    dataset: {path: chat/train.jsonl, tokenizer: model/, seq_len: 2048}
"""

from typing import Literal

import msgspec

from d9d.data import (
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    TextDataset,
    collate_preference,
    collate_prompts,
)
from d9d.trainer.config.base import ConfigPath
from d9d.trainer.providers.data import BuildDatasetContext, BuildDatasetResult

__all__ = [
    "ChatDatasetConfig",
    "ChatDatasetProvider",
    "PreferenceDatasetConfig",
    "PreferenceDatasetProvider",
    "PromptDatasetConfig",
    "PromptDatasetProvider",
    "TextDatasetConfig",
    "TextDatasetProvider",
]


class ChatDatasetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` (and `eval_dataset:`) section: conversations for supervised fine-tuning.

    Attributes:
        path: a .jsonl file or a folder of them (`{"messages": [...]}` or `{"prompt", "completion"}`).
        tokenizer: a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json with the
            chat template); usually the model's folder.
        seq_len: tokens per row.
        pack: several conversations per row, never attending to each other (position and document ids).
        train_on: "assistant" (loss on the assistant's tokens only) or "all".
        overflow: "truncate" or "drop" conversations longer than seq_len.
        roles: the message roles the conversations may use (another is refused with its file:line).
    """

    path: ConfigPath
    tokenizer: ConfigPath
    seq_len: int = 256
    pack: bool = True
    train_on: Literal["assistant", "all"] = "assistant"
    overflow: Literal["truncate", "drop"] = "truncate"
    roles: tuple[str, ...] = ("system", "user", "assistant", "tool")


class ChatDatasetProvider:
    """`d9d.data.SFTDataset` over the configured JSONL, with the model's tokenizer and chat template."""

    config_type = ChatDatasetConfig

    def __init__(self, config: ChatDatasetConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        c = self.config
        dataset = SFTDataset(c.path, c.seq_len, tokenizer=c.tokenizer, train_on=c.train_on,
                             overflow=c.overflow, pack=c.pack, roles=c.roles)  # fmt: skip
        return BuildDatasetResult(dataset=dataset)


class PreferenceDatasetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` (and `eval_dataset:`) section: preference pairs (TRL's prompt / chosen / rejected).

    Attributes:
        path: a .jsonl file or a folder of them (`{"prompt", "chosen", "rejected"}`, plain text or
            message lists).
        tokenizer: a Hugging Face tokenizer folder (with the chat template for message lists); usually
            the model's folder.
        seq_len: tokens per row.
        pack: several whole pairs per row (position and document ids keep every sequence apart).
        overflow: "truncate" (keep the start) or "drop" pairs longer than seq_len.
    """

    path: ConfigPath
    tokenizer: ConfigPath
    seq_len: int = 256
    pack: bool = False
    overflow: Literal["truncate", "drop"] = "truncate"


class PreferenceDatasetProvider:
    """`d9d.data.PreferenceDataset` over the configured JSONL, collated by `d9d.data.collate_preference`
    (its batch format is in `PreferenceDataset`'s docstring)."""

    config_type = PreferenceDatasetConfig

    def __init__(self, config: PreferenceDatasetConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        c = self.config
        dataset = PreferenceDataset(
            c.path, c.seq_len, tokenizer=c.tokenizer, overflow=c.overflow, pack=c.pack
        )
        return BuildDatasetResult(dataset=dataset, collate_fn=collate_preference, document_masking=c.pack)


class PromptDatasetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` section of prompts for RL (`d9d.trainer:GRPOTask`).

    Attributes:
        path: a .jsonl file or a folder of them (`{"prompt": text or messages, ...other fields for the
            reward function}`).
        max_prompt_len: the most tokens a prompt may have (a longer one is refused with its file:line).
        tokenizer: a Hugging Face tokenizer folder (with the chat template for message prompts); null:
            bytes (vocabulary 257).
    """

    path: ConfigPath
    max_prompt_len: int = 256
    tokenizer: ConfigPath | None = None


class PromptDatasetProvider:
    """`d9d.data.PromptDataset` over the configured JSONL, collated by `d9d.data.collate_prompts`."""

    config_type = PromptDatasetConfig

    def __init__(self, config: PromptDatasetConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        c = self.config
        dataset = PromptDataset(c.path, c.max_prompt_len, tokenizer=c.tokenizer)
        return BuildDatasetResult(dataset=dataset, collate_fn=collate_prompts, seq_len=None)


class TextDatasetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` section of plain text: a .txt file (or a folder of them), packed into rows.

    Attributes:
        path: the text file or folder.
        seq_len: tokens per row.
        tokenizer: a tokenizer folder or tokenizer.json; null: bytes (vocabulary 257: 256 bytes and the
            end of a document).
        document_masking: rows carry `position_ids` and `document_ids`, so the packed documents (a
            file each) do not attend to each other.
    """

    path: ConfigPath
    seq_len: int = 128
    tokenizer: ConfigPath | None = None
    document_masking: bool = False


class TextDatasetProvider:
    """`d9d.data.TextDataset`: the text in the given tokenizer's ids (bytes without one), packed."""

    config_type = TextDatasetConfig

    def __init__(self, config: TextDatasetConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        c = self.config
        dataset = TextDataset(c.path, c.seq_len, tokenizer=c.tokenizer, document_masking=c.document_masking)
        return BuildDatasetResult(dataset=dataset, document_masking=c.document_masking)
