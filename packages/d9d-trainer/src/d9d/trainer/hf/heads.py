"""Heads on a transformers model (`model.head`): transformers' own `AutoModelForSequenceClassification`
for a classifier (its `score` Linear and its config keys: `num_labels`, `id2label`, `pad_token_id`), and
the same base model without the score for embeddings.

A causal LM's folder gives a fresh score (transformers' `_init_weights`, seeded by d9d per module
path; its `lm_head` is not read); a folder saved by `AutoModelForSequenceClassification` gives its
own. The pooling is the reference model's (`d9d.trainer.models.heads.pool`), which picks the token
transformers' classifier picks.
"""

import copy
from typing import Any

import torch
from transformers import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from d9d.trainer.hf.errors import HFModelError
from d9d.trainer.hf.folder import CONFIG_FILE, HFFolder, quiet_transformers
from d9d.trainer.models.config import ClassificationHead, EmbeddingHead, HeadConfig

__all__ = ["HEAD_ONLY_KEYS", "build_head_model", "exported_architecture", "head_problem", "head_weight"]

#: The head's own tensors: a causal LM's folder lacks them (they start from their init).
HEAD_ONLY_KEYS = frozenset({"score.weight"})
#: The causal LM's head a folder may hold, which a head model does not read.
LM_HEAD_PATTERN = r"^lm_head\."


def head_problem(folder: HFFolder, head: HeadConfig) -> str | None:
    """Why transformers cannot put `head` on the folder's model (None when it can)."""
    del head
    if type(folder.config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        return (
            f"model.head: {folder.path / CONFIG_FILE}'s model_type {folder.model_type!r} has no sequence "
            "classifier in transformers (AutoModelForSequenceClassification), which the head is built from; "
            "remove model.head, or use a model that has one"
        )
    return None


def build_head_model(folder: HFFolder, head: HeadConfig, attention: str) -> PreTrainedModel:
    """transformers' classifier of the folder's architecture (float32, current device), with the head's
    `num_labels`, label names and padding token in its config; for an embedding head, without `score`.

    Raises:
        HFModelError: the architecture has no classifier in transformers (`head_problem`).
    """
    problem = head_problem(folder, head)
    if problem is not None:
        raise HFModelError(problem)
    config = copy.deepcopy(folder.config)
    if head.pad_token_id is not None:
        config.pad_token_id = head.pad_token_id
    if isinstance(head, ClassificationHead):
        names = head.id2label or {i: f"LABEL_{i}" for i in range(head.num_labels)}
        config.id2label = dict(sorted(names.items()))
        config.label2id = {name: i for i, name in config.id2label.items()}
        config.num_labels = head.num_labels
    with quiet_transformers():
        model = AutoModelForSequenceClassification.from_config(
            config, dtype=torch.float32, attn_implementation=attention
        )
    if isinstance(head, EmbeddingHead):
        del model.score  # the pooled hidden states are the output
    return model


def head_weight(model: PreTrainedModel) -> torch.nn.Module | None:
    """The classifier's `score` (None for an embedding model)."""
    score = model._modules.get("score")
    return score if isinstance(score, torch.nn.Module) else None


def exported_architecture(model: Any) -> str:
    """config.json's `architectures` entry of an export of `model` (an `HFCausalLM`): its class, or for
    an embedding model the base model's (`LlamaModel`), which `AutoModel` loads.

    Raises:
        HFModelError: a classification (reward) head without its score.
    """
    hf_model = model.hf_model
    if isinstance(model.head, EmbeddingHead):
        return type(model.get_submodule(model.base_model_path)).__name__
    if isinstance(model.head, ClassificationHead) and head_weight(hf_model) is None:
        raise HFModelError(
            "model.head asks for a sequence classifier but the exported model has no score head "
            "(score.weight); build it with the same model.head before exporting"
        )
    return type(hf_model).__name__
