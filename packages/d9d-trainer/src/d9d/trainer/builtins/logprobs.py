"""Each label's log-probability from what a causal LM returns: its logits, or a fused head's per-token
losses (`d9d.parallel.set_head_reduction(model, "none")`). Shared by the tasks that score sequences
(preference optimization) and tokens (RL)."""

import torch
import torch.nn.functional as F

from d9d.data import IGNORE_INDEX
from d9d.trainer.errors import TrainingError

__all__ = ["token_logps"]


def token_logps(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each label's log-probability (float32, flat; 0 where ignored) from the model's logits [rows,
    seq, vocab] or a fused head's per-token losses [rows, seq].

    Raises:
        TrainingError: `output` is neither (e.g. a fused head's summed loss).
    """
    if output.ndim == labels.ndim + 1:
        return -F.cross_entropy(
            output.reshape(-1, output.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
    if output.shape == labels.shape:
        return -output.float().reshape(-1)
    raise TrainingError(
        f"the task needs the model's logits [rows, seq, vocab] or its head's per-token losses [rows, seq]; "
        f"the model returned shape {tuple(output.shape)} for labels {tuple(labels.shape)} (a fused head "
        "sums its loss unless set_head_reduction(model, 'none') is set)"
    )
