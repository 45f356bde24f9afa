"""The `model:` section of `d9d.trainer.hf:HFCausalLMProvider`."""

from typing import Literal

import msgspec

from d9d.trainer.config.base import ConfigPath
from d9d.trainer.models.config import HeadConfig

__all__ = ["HFCausalLMConfig"]


class HFCausalLMConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which Hugging Face model folder to train, and how to run its forward.

    Attributes:
        folder: a local Hugging Face model folder (config.json and the weights as `model.safetensors`
            or shards with `model.safetensors.index.json`), relative to the config file's directory
            like every path of a job. Nothing is downloaded.
        fp32_logits: return float32 logits whatever the compute dtype.
        attention: transformers' attention implementation: `auto` (sdpa where the architecture has
            it, else eager), `sdpa` or `eager`. `trainer.attention.backend` other than auto decides it
            instead: `flex_attention` for flex, `sdpa` (restricted to the kernel) for the others.
        head: a classification head or an embedding output (`kind: classification | embedding`, as the
            reference model's `model.head`), built from transformers' `AutoModelForSequenceClassification`;
            None: the causal LM. The padding token defaults to config.json's `pad_token_id`.
    """

    folder: ConfigPath
    fp32_logits: bool = False
    attention: Literal["auto", "sdpa", "eager"] = "auto"
    head: HeadConfig | None = None
