"""What a run reports back: `TrainResult` (what `Trainer.train()` or `run_job` did) and `EvalResult`
(one eval's numbers).

Torch-free, so that `run_job` can answer for a finished run from its checkpoint's commit record
without importing the trainer, and callbacks can name them without importing the loop.
"""

from dataclasses import dataclass, field

__all__ = ["EvalResult", "TrainResult"]


@dataclass(frozen=True)
class TrainResult:
    """What `Trainer.train()` did."""

    start_step: int
    final_step: int
    losses: list[float]
    stopped_by: str | None = None
    """What stopped the run early: a signal ("SIGTERM"; `preempted`), a callback's `request_stop`
    reason (the run is finished: saved, it exports, a re-run says it already stopped), or on a rank
    that did not ask "a signal on another rank" / "a callback on another rank"; None otherwise."""
    preempted: bool = False
    """A signal stopped the run to be resumed (saved unless `save_on_signal: false`): the command exits
    `EXIT_PREEMPTED` (75) and does not export. False for every other end, a callback's stop included."""
    early_stopped: str | None = None
    """Why `eval.early_stopping` ended the run (saved, and finished: it exports); None when it did not."""
    data_ended: bool = False
    """The data ran out (a mixture with `exhausted: stop`) before `total_steps`: the run ended, saved."""


@dataclass(frozen=True)
class EvalResult:
    """One eval's numbers, the same on every rank.

    Attributes:
        step: the optimizer step after which it ran.
        loss: mean token loss over the evaluated set (sum of token losses / tokens).
        perplexity: exp(loss) (inf where that overflows).
        tokens: labelled tokens evaluated (the task's weight: e.g. pairs for a preference task).
        wall_s: how long it took.
        metrics: the task's metrics over the whole set (`ReportsMetrics`), recorded as `eval_<name>`.
    """

    step: int
    loss: float
    perplexity: float
    tokens: float
    wall_s: float
    metrics: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, float]:
        """The keys it adds to its step's `metrics.jsonl` record."""
        return {
            "eval_loss": self.loss,
            "eval_perplexity": self.perplexity,
            "eval_tokens": self.tokens,
            **{f"eval_{name}": value for name, value in self.metrics.items()},
        }
