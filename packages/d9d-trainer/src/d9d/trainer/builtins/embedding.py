"""Contrastive embedding training (`d9d.trainer:EmbeddingTask`): in-batch InfoNCE over (query,
positive) pairs on a model with an embedding head (`model.head: {kind: embedding}`), configured by the
job's `task:` section.

    providers: {task: d9d.trainer:EmbeddingTask}
    task: {temperature: 0.05}

A microbatch holds `input_ids` [pairs, 2, seq] (each sample a (query, positive) pair of rows, as a
dataset of pairs collates) or [2·pairs, seq] with row 2k pair k's query and row 2k+1 its positive
(with packed rows, `position_ids` and `document_ids`, the documents in that order). Each query's negatives
are the other positives of the microbatch on every data-parallel rank: the positives are all-gathered
with autograd (`torch.distributed.nn.functional.all_gather`), so the gradient of every rank's loss
flows back to the rank that embedded each positive, and a step equals one process's whose microbatch
holds the same pairs as the dp ranks' microbatches together.
"""

import math
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from d9d.trainer.errors import TrainingError
from d9d.trainer.providers.task import LossContext, LossResult, PrepareRunContext

__all__ = ["EmbeddingConfig", "EmbeddingTask", "contrastive_loss"]

#: Keys of a packed batch that the model takes besides `input_ids`.
_PACKED_KEYS = ("position_ids", "document_ids")


class EmbeddingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `task:` section.

    Attributes:
        temperature: the similarities (dot products of the embeddings: cosines when the head
            normalizes) are divided by it before the softmax.
    """

    temperature: float = 0.05

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"task.temperature must be a positive number, got {self.temperature}")


def _gathered(positives: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """Every rank's positives of `group` in rank order (differentiable), and where this rank's start.
    Ranks may hold different counts (an eval's last microbatch): padded for the gather (one host
    read of the counts), the padding dropped after."""
    if group is None or dist.get_world_size(group) == 1:
        return positives, 0
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = torch.tensor([positives.shape[0]], device=positives.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in torch.cat(counts).tolist()]
    padded = F.pad(positives, (0, 0, 0, max(sizes) - positives.shape[0]))
    parts = dist_nn.all_gather(padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)]), sum(sizes[:rank])


def contrastive_loss(
    queries: torch.Tensor, positives: torch.Tensor, temperature: float, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed InfoNCE loss of this rank's queries [pairs, hidden] against every rank's positives,
    and how many queries rank their own positive first (both float32, 0-dim).

    Args:
        group: the data-parallel ranks whose positives are the negatives (None: this rank's only).
    """
    everyone, offset = _gathered(positives, group)
    logits = queries.float() @ everyone.float().T / temperature
    targets = torch.arange(queries.shape[0], device=queries.device) + offset
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.detach().argmax(-1) == targets).sum().float()
    return loss, correct


class EmbeddingTask:
    """In-batch contrastive training of an embedding model over (query, positive) pairs.

    The loss is InfoNCE summed over the pairs, the weight the pair count: the trainer's normalization
    makes it the mean over the global batch. Metric: `accuracy`, the share of queries whose own
    positive is the most similar of the gathered ones (per step; `eval_accuracy` over the whole eval
    set, in-batch retrieval among each eval microbatch's positives across the dp ranks).
    """

    config_type = EmbeddingConfig
    config_section = "task"
    supports_context_parallel = False  # one embedding a sequence: whole sequences on one rank
    metric_names = ("accuracy",)

    def __init__(self, config: EmbeddingConfig | None = None) -> None:
        self.config = config or EmbeddingConfig()
        self._group: dist.ProcessGroup | None = None

    def prepare_run(self, context: PrepareRunContext) -> None:
        """Keep the data-parallel group, whose positives are every query's negatives."""
        ctx = context.context
        self._group = None if ctx.is_local or ctx.axis_size("dp") == 1 else ctx.mesh("batch").get_group("dp")

    def batch_weight(self, batch: Any) -> int:
        """The microbatch's pairs (half its sequences)."""
        return _pairs(batch)

    def compute_loss(self, context: LossContext) -> LossResult:
        """Embed the batch's sequences and score each query against the gathered positives.

        Raises:
            TrainingError: the model returns another number of embeddings than the batch's sequences.
        """
        batch = {k: _rows(v) for k, v in context.batch.items() if k == "input_ids" or k in _PACKED_KEYS}
        packed = {k: batch[k].to(context.device, non_blocking=True) for k in _PACKED_KEYS if k in batch}
        embeddings = context.model(batch["input_ids"].to(context.device, non_blocking=True), **packed)
        pairs = _pairs(batch)
        if embeddings.ndim != 2 or embeddings.shape[0] != 2 * pairs:
            raise TrainingError(
                f"the model returns outputs of shape {tuple(embeddings.shape)} for {2 * pairs} sequences; "
                "give it an embedding head (model.head: {kind: embedding}) and the batch a query and a "
                "positive per pair"
            )
        loss, correct = contrastive_loss(
            embeddings[0::2], embeddings[1::2], self.config.temperature, self._group
        )
        return LossResult(loss_sum=loss, weight=pairs, metrics={"accuracy": correct})


def _rows(value: torch.Tensor) -> torch.Tensor:
    """[pairs, 2, seq] → [2·pairs, seq] (query, positive, query, ...); rows as they are."""
    return value.flatten(0, 1) if value.ndim == 3 else value


def _pairs(batch: Any) -> int:
    """The pairs of a batch: half its rows, or of its packed documents (one host read of their count)."""
    documents = batch.get("document_ids")
    if documents is None:
        rows = _rows(batch["input_ids"]).shape[0]
    else:
        documents = _rows(documents)
        starts = torch.ones_like(documents, dtype=torch.bool)
        starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
        rows = int((starts & (documents >= 0)).sum())
    if rows % 2:
        raise TrainingError(
            f"a batch has {rows} sequences; give a query and a positive per pair (an even count)"
        )
    return rows // 2
