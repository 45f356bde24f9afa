"""Best checkpoints: which committed checkpoints rank best by a metric their commit records hold.

Decided from the commit records alone (`CheckpointMeta.metrics`, written at save time), so retention,
`d9d checkpoints` and `d9d export --best` agree, need no tensors and no torch, and a crash between
two saves cannot change the answer. A checkpoint whose record lacks the metric (or holds NaN) is
never best. Ties go to the earlier step: it reached the value first.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from d9d.ckpt.checkpoint.layout import CheckpointInfo

__all__ = ["KeepBest", "best_checkpoints", "metric_of"]


@dataclass(frozen=True)
class KeepBest:
    """Keep the `count` checkpoints with the lowest (`mode="min"`) or highest (`"max"`) `metric`."""

    metric: str
    mode: str = "min"
    count: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best.mode must be 'min' or 'max', got {self.mode!r}")
        if self.count < 1:
            raise ValueError(f"keep_best.count must be >= 1, got {self.count}")


def metric_of(info: CheckpointInfo, metric: str) -> float | None:
    """The value of `metric` that `info`'s commit record holds; None when it has none (or NaN)."""
    value = (info.meta.metrics or {}).get(metric)
    if value is None or math.isnan(value):
        return None
    return float(value)


def best_checkpoints(committed: Sequence[CheckpointInfo], policy: KeepBest) -> list[CheckpointInfo]:
    """The `policy.count` best of `committed` by their recorded metric, best first."""
    scored = [(value, info) for info in committed if (value := metric_of(info, policy.metric)) is not None]
    sign = 1.0 if policy.mode == "min" else -1.0
    scored.sort(key=lambda pair: (sign * pair[0], pair[1].step))
    return [info for _, info in scored[: policy.count]]
