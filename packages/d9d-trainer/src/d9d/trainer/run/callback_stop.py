"""A run a callback stopped (`RunControl.request_stop`): it is finished, like one early stopping ended.

The save of the step it stopped at records which callback asked, why, and that step, in the
checkpoint's extra state (`CallbackStop.state`), so the record and the weights commit together. A
run resumed from that checkpoint trains nothing while the callback is still among the run's: it says
the run already stopped and ends as finished. Without it (the callback taken out of
`trainer.callbacks`) the run trains on from there.
"""

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

__all__ = ["CallbackStop"]


@dataclass(frozen=True)
class CallbackStop:
    """Which callback stopped the run, why, and at which step (the step saved).

    Attributes:
        callback: its class name; None when it asked on another rank than rank 0 (which saves).
        reason: what it gave `request_stop` (or "a callback on another rank").
        step: the last step trained, the checkpoint's.
    """

    callback: str | None
    reason: str
    step: int

    def state(self) -> dict[str, Any]:
        """The checkpoint's extra-state entry."""
        return {"callback": self.callback, "reason": self.reason, "step": self.step}

    @classmethod
    def from_state(cls, state: Any) -> "CallbackStop | None":
        """The record of a checkpoint's extra-state entry; None without one (or one not of this form)."""
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return None
        callback = state.get("callback")
        return cls(callback=callback if isinstance(callback, str) else None, reason=str(state.get("reason")),
                   step=state["step"])  # fmt: skip

    def holds(self, callbacks: Set[str]) -> bool:
        """Whether the run is still stopped for a run with these callbacks (class names): the one that
        stopped it is among them (any, when which one is not known)."""
        return self.callback in callbacks if self.callback is not None else bool(callbacks)

    def describe(self) -> str:
        """`callback LossTarget (loss 3.9 below 4.0 at step 11)`, for the log lines."""
        return f"callback {self.callback or '(on another rank)'} ({self.reason})"
