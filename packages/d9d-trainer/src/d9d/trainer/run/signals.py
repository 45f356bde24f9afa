"""Stopping on a signal: SIGTERM (pre-emption by SLURM or Kubernetes, torchrun's shutdown) or Ctrl-C.

While a job trains, the first SIGTERM or SIGINT only asks for a stop. Every rank finishes its step;
the ranks agree on the stop inside the step (one tiny all-gather read with the step's one host
sync), so they all stop after the same step, save a checkpoint (`trainer.checkpointing.
save_on_signal`), and exit with `EXIT_PREEMPTED`. A second Ctrl-C stops at once (KeyboardInterrupt).
"""

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from d9d.mesh import get_logger

__all__ = ["EXIT_INTERRUPTED", "EXIT_PREEMPTED", "INTERRUPTED_MESSAGE", "StopRequests"]

#: Exit status of a job stopped by SIGTERM or Ctrl-C after saving (EX_TEMPFAIL: run it again to resume).
EXIT_PREEMPTED = 75
#: Exit status after a second Ctrl-C (stopped at once, as a shell reports SIGINT).
EXIT_INTERRUPTED = 130
#: What a second Ctrl-C prints (one line, no traceback).
INTERRUPTED_MESSAGE = (
    "error: interrupted by a second Ctrl-C; the last committed checkpoint stays the latest; run the same "
    "command to resume from it"
)

_log = get_logger("d9d.trainer")


class StopRequests:
    """SIGTERM / SIGINT handlers for the duration of a `with` block (on the main thread only)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """A signal asked this process to stop after the current step."""
        return self.signal_name is not None

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # a repeated SIGTERM changes nothing: the stop is under way
        self.signal_name = name
        _log.warning(f"{name} received: stopping after this step", second_ctrl_c="stops at once")
