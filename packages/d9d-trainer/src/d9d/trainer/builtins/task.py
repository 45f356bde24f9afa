"""The built-in task: next-token prediction (`d9d.trainer:CausalLMTask`), packed documents included."""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from d9d.data import IGNORE_INDEX
from d9d.trainer.providers.task import LossContext, LossResult, fused_loss_chunk_size

__all__ = ["CausalLMTask"]


#: Keys of a packed batch that the model takes besides `input_ids` (positions restart per document).
_PACKED_KEYS = ("position_ids", "document_ids")


class CausalLMTask:
    """Next-token prediction: `batch` is a mapping with `input_ids` and `labels` (already shifted).

    The loss is the summed token cross-entropy; the weight is the number of labels that are not
    `IGNORE_INDEX`, so the trainer's normalization makes it the mean over the global batch's tokens.
    A model whose head computes the loss fused (`ComputesTokenLoss`: the reference model and the
    Hugging Face backend with `trainer.loss.fused`) is given the labels and returns it, so no
    [tokens, vocab] logits exist; any other model returns logits, whose float32 cross-entropy is taken.
    """

    config_type = None

    def __init__(self, config: Any = None) -> None:
        del config

    def batch_weight(self, batch: Any) -> torch.Tensor:
        """Tokens that carry a label in this microbatch (a tensor: reading it would sync the host)."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward `input_ids` and sum the cross-entropy over every labelled token.

        Packed documents (a batch with `position_ids` and `document_ids`, e.g. d9d.data's
        `document_masking` or a packed `SFTDataset`) pass them to the model as keyword arguments, so
        attention stays within each document and positions restart per document.
        """
        batch = context.batch
        input_ids = batch["input_ids"].to(context.device, non_blocking=True)
        labels = batch["labels"].to(context.device, non_blocking=True)
        packed = {
            key: batch[key].to(context.device, non_blocking=True) for key in _PACKED_KEYS if key in batch
        }
        model = context.model
        if fused_loss_chunk_size(model) is not None:
            return self.pipeline_loss(model(input_ids, labels=labels, **packed), labels)
        return self.pipeline_loss(model(input_ids, **packed), labels)

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Under pipeline parallelism: the first stage gets `input_ids`, the loss gets `labels`."""
        return batch["input_ids"], batch["labels"]

    def pipeline_kwargs(self, batch: Any, stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """Under pipeline parallelism, what every stage's forward takes besides its input: a packed
        batch's `position_ids` and `document_ids` (each stage's attention stays within each document),
        and `labels` when this rank's last stage computes its loss fused (other stages ignore them)."""
        kwargs = {key: batch[key] for key in _PACKED_KEYS if key in batch}
        if any(fused_loss_chunk_size(stage) is not None for stage in stages):
            kwargs["labels"] = batch["labels"]
        return kwargs

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossResult:
        """Summed cross-entropy of `logits` against `labels` (labels equal to IGNORE_INDEX skipped).

        A 0-dim `logits` is that loss already, computed by a fused head given the labels
        (`compute_loss`, `pipeline_kwargs`).
        """
        labels = labels.to(logits.device)
        if logits.ndim == 0:
            return LossResult(loss_sum=logits, weight=(labels != IGNORE_INDEX).sum())
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return LossResult(loss_sum=loss, weight=(labels != IGNORE_INDEX).sum())
