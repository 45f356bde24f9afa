"""Sequence classification (`d9d.trainer:SequenceClassificationTask`): cross-entropy over a model with
a classification head (`model.head: {kind: classification, num_labels}`), configured by the job's
`task:` section.

    providers: {task: d9d.trainer:SequenceClassificationTask}
    task: {num_labels: 3}

A microbatch holds `input_ids` [rows, seq] and `labels` [sequences] in 0..num_labels-1: one label a
row, or with packed rows (`position_ids`, `document_ids`) one a document, in row-major order (the
order the head returns its scores in). Accuracy and macro F1 are computed from per-class counts summed
over the whole step (or the whole eval set) and every data-parallel rank, so they are what one
process computes over the same samples.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from d9d.trainer.errors import TrainingError
from d9d.trainer.providers.task import LossContext, LossResult

__all__ = ["SequenceClassificationConfig", "SequenceClassificationTask", "macro_f1"]

#: Keys of a packed batch that the model takes besides `input_ids`.
_PACKED_KEYS = ("position_ids", "document_ids")


class SequenceClassificationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `task:` section.

    Attributes:
        num_labels: the classes; the model's head must score as many (`model.head.num_labels`).
    """

    num_labels: int

    def __post_init__(self) -> None:
        if self.num_labels < 1:
            raise ValueError(f"task.num_labels={self.num_labels} must be at least 1")


def macro_f1(tp: Sequence[float], fp: Sequence[float], fn: Sequence[float]) -> float:
    """The mean over classes of 2·TP / (2·TP + FP + FN), over the classes that occur among the labels
    or the predictions (scikit-learn's `f1_score(average="macro")`); nan when none does."""
    scores = [2 * t / (2 * t + p + n) for t, p, n in zip(tp, fp, fn, strict=True) if 2 * t + p + n > 0]
    return sum(scores) / len(scores) if scores else float("nan")


class SequenceClassificationTask:
    """Cross-entropy of the head's [sequences, num_labels] scores against `labels`.

    The loss is summed over the sequences and the weight is their count: the trainer's normalization
    makes it the mean over the global batch. Metrics: `accuracy` and `f1` (macro), both over the global
    batch (per step) or the whole eval set (`eval_accuracy`, `eval_f1`), from the summed counts
    `correct`, `tp/<c>`, `fp/<c>`, `fn/<c>` (the trainer reduces sums; `summarize_metrics` turns them
    into the reported values).
    """

    config_type = SequenceClassificationConfig
    config_section = "task"
    supports_context_parallel = False  # one score a sequence: whole sequences on one rank

    def __init__(self, config: SequenceClassificationConfig) -> None:
        self.config = config
        classes = range(config.num_labels)
        self.metric_names = (
            "correct",
            *(f"tp/{c}" for c in classes),
            *(f"fp/{c}" for c in classes),
            *(f"fn/{c}" for c in classes),
        )

    def batch_weight(self, batch: Any) -> int:
        """The microbatch's labelled sequences."""
        return int(batch["labels"].numel())

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward the batch (packed rows pass `position_ids` and `document_ids`) and score the labels."""
        batch = context.batch
        self._check_labels(batch["labels"])
        packed = {k: batch[k].to(context.device, non_blocking=True) for k in _PACKED_KEYS if k in batch}
        scores = context.model(batch["input_ids"].to(context.device, non_blocking=True), **packed)
        return self.pipeline_loss(scores, batch["labels"])

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Under pipeline parallelism: the first stage gets `input_ids`, the loss gets `labels`."""
        self._check_labels(batch["labels"])
        return batch["input_ids"], batch["labels"]

    def pipeline_kwargs(self, batch: Any, stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """What every stage takes besides its input: the packed keys, and the token ids (`tokens`),
        by which the last stage finds each sequence's last non-padding token."""
        del stages
        return {**{k: batch[k] for k in _PACKED_KEYS if k in batch}, "tokens": batch["input_ids"]}

    def pipeline_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> LossResult:
        """Summed cross-entropy of `scores` [sequences, num_labels] against `labels` [sequences], and the
        summed counts of the metrics.

        Raises:
            TrainingError: the model scores another number of classes, or of sequences, than the labels.
        """
        labels = labels.to(scores.device).reshape(-1)
        classes = self.config.num_labels
        if scores.ndim != 2 or scores.shape[-1] != classes:
            raise TrainingError(
                f"the model returns scores of shape {tuple(scores.shape)} but task.num_labels={classes}; "
                f"give the model a classification head of as many labels (model.head.num_labels: {classes})"
            )
        if scores.shape[0] != labels.numel():
            raise TrainingError(
                f"the model scores {scores.shape[0]} sequences but the batch has {labels.numel()} labels; "
                "give one label a row (or a packed document)"
            )
        loss = F.cross_entropy(scores.float(), labels, reduction="sum")
        predicted = scores.detach().argmax(-1)
        hits = F.one_hot(predicted, classes) & F.one_hot(labels, classes)
        tp = hits.sum(0)
        fp = F.one_hot(predicted, classes).sum(0) - tp
        fn = F.one_hot(labels, classes).sum(0) - tp
        metrics = {"correct": tp.sum()}
        for name, counts in (("tp", tp), ("fp", fp), ("fn", fn)):
            metrics |= {f"{name}/{c}": counts[c] for c in range(classes)}
        return LossResult(loss_sum=loss, weight=labels.numel(), metrics=metrics)

    def summarize_metrics(self, totals: Mapping[str, float], weight: float) -> dict[str, float]:
        """`accuracy` (correct over the labelled sequences) and macro `f1`, from the global sums."""
        classes = range(self.config.num_labels)
        counts = [[totals[f"{kind}/{c}"] for c in classes] for kind in ("tp", "fp", "fn")]
        accuracy = totals["correct"] / weight if weight else float("nan")
        return {"accuracy": accuracy, "f1": macro_f1(*counts)}

    def _check_labels(self, labels: torch.Tensor) -> None:
        """Refuse labels outside 0..num_labels-1, read from the host copy the data loader gives (no
        device read); labels already on an accelerator are left to the loss."""
        if labels.device.type != "cpu" or labels.numel() == 0:
            return
        low, high = int(labels.min()), int(labels.max())
        classes = self.config.num_labels
        if low < 0 or high >= classes:
            raise TrainingError(
                f"a batch has label {low if low < 0 else high}, outside 0..{classes - 1} (task.num_labels="
                f"{classes}); fix the dataset's labels or raise task.num_labels and model.head.num_labels"
            )
