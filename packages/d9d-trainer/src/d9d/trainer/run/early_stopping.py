"""Early stopping (`eval.early_stopping`): stop once `eval_loss` stopped improving for `patience` evals.

An eval improves when its loss is below the best so far by more than `min_delta` (the first eval
always does); `patience` evals in a row without improvement stop the run at that eval's step, which
is then saved. Every rank sees the same eval numbers (one all-reduce, see `evaluation.py`), so every
rank decides alike at the eval step itself: no extra collective, no step after the decision. The
state (best loss, evals since the best) goes into each checkpoint's extra state, so a resumed run
counts on where it left off.
"""

import math
from typing import Any

from d9d.trainer.config.job import EarlyStoppingConfig

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """The patience counter of one run; `observe` each eval's loss, `state_dict` into each save."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self._config = config
        self.best: float | None = None
        self.evals_without_improvement = 0

    @property
    def exhausted(self) -> bool:
        """The run has run out of patience (e.g. already when resumed from the checkpoint that stopped it)."""
        return self.evals_without_improvement >= self._config.patience

    def observe(self, loss: float) -> bool:
        """Count one eval's loss; True when the run must stop now."""
        if not math.isnan(loss) and (self.best is None or loss < self.best - self._config.min_delta):
            self.best = loss
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        return self.exhausted

    def reason(self) -> str:
        """Why it stopped, for the log and `TrainResult.early_stopped`."""
        return (
            f"early stopping: eval_loss has not improved on {self.best} by more than {self._config.min_delta} "
            f"for {self.evals_without_improvement} evals (patience {self._config.patience})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "evals_without_improvement": self.evals_without_improvement}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.evals_without_improvement = int(state.get("evals_without_improvement", 0))
