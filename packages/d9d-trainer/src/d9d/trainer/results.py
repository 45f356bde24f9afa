"""`TrainResult`: what a run of `Trainer.train()` (or `run_job`) did.

Torch-free, so that `run_job` can answer for a finished run from its checkpoint's commit record
without importing the trainer.
"""

from dataclasses import dataclass

__all__ = ["TrainResult"]


@dataclass(frozen=True)
class TrainResult:
    """What `Trainer.train()` did."""

    start_step: int
    final_step: int
    losses: list[float]
    stopped_by: str | None = None
    """What stopped the run early, after saving: a signal ("SIGTERM"), a callback's `request_stop`
    reason, or (on the other ranks) "a signal or a callback on another rank"; None when it finished."""
    early_stopped: str | None = None
    """Why `eval.early_stopping` ended the run (saved, and finished: it exports); None when it did not."""
    data_ended: bool = False
    """The data ran out (a mixture with `exhausted: stop`) before `total_steps`: the run ended, saved."""
