"""`StepWatchdog`: a hung or failed rank stops every rank of the job, with one clear report.

Each rank runs a watchdog thread while it trains. It polls the job's `FailureBoard`: when another
rank recorded a failure, this rank (blocked in a collective with it, most likely) stops at once with
exit status 2, rank 0 printing that rank's error. And when this rank's step passes
`trainer.timeouts.step_s`, the thread When this rank's step passes the limit, the thread looks at what
the training thread is doing: blocked in a torch.distributed collective (waiting for someone), or
elsewhere (the stuck one). Every rank posts that to the job's store, reads the others' posts for a
moment, logs an error naming the stuck ranks (the stuck rank also logs its stack), and exits with
`EXIT_STEP_TIMEOUT`. Both exit from the thread: a blocked or hung rank may never return to Python, so raising would not be enough (the
NCCL watchdog aborts likewise). A checkpoint being written at that moment stays uncommitted.
"""

import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch.distributed as dist

from d9d.mesh import get_logger
from d9d.trainer.failures import FailureBoard

__all__ = ["EXIT_STEP_TIMEOUT", "REPORT_GRACE_S", "StepWatchdog"]

#: Exit status of every rank of a job stopped by the step watchdog.
EXIT_STEP_TIMEOUT = 3
#: Seconds the ranks wait for each other's reports after the limit passed.
REPORT_GRACE_S = 2.0
#: Exit status of a rank stopped because another rank failed (as for every reported d9d error).
_EXIT_PEER_FAILED = 2
#: How often the thread looks for another rank's failure.
_POLL_S = 0.5
_COLLECTIVE_PATH = f"{os.sep}torch{os.sep}distributed{os.sep}"
_INNER_FRAMES = 4
_log = get_logger("d9d.trainer")


class StepWatchdog:
    """Watches the steps of one rank; `with watchdog.step(n):` arms it for the duration of step n."""

    def __init__(
        self, store: dist.Store, failures: FailureBoard, rank: int, world_size: int, limit_s: float
    ) -> None:
        self._store = store
        self._failures = failures
        self._rank = rank
        self._world_size = world_size
        self._limit_s = limit_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._armed: tuple[int, float, int] | None = None  # (step, deadline, thread id)
        self._closed = False
        self._exiting = threading.Event()
        self._thread = threading.Thread(target=self._run, name="d9d-step-watchdog", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Arm the watchdog for `step` (from now until the block exits)."""
        with self._lock:
            self._armed = (step, time.monotonic() + self._limit_s, threading.get_ident())
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._armed = None
            self._wake.set()

    def hold_if_exiting(self) -> None:
        """Block for good when the watchdog is ending the process (its report must come alone)."""
        if self._exiting.is_set():
            threading.Event().wait()

    def close(self) -> None:
        """Stop the watchdog thread."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                armed = self._armed
            wait = _POLL_S if armed is None else min(max(armed[1] - time.monotonic(), 0.0), _POLL_S)
            self._wake.wait(wait)
            self._wake.clear()
            if self._closed:
                return
            with contextlib.suppress(Exception):  # a store that went away is not this rank's failure
                failed = self._failures.first_failure()
                if failed is not None and failed[0] != self._rank:
                    self._stop_for_peer(*failed)
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() >= armed[1]:
                self._fire(armed[0], armed[2])

    def _stop_for_peer(self, rank: int, message: str) -> None:
        self._exiting.set()
        _log.warning("stopping: another rank failed first", failed_rank=rank)
        if self._rank == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        self._failures.linger(stopping=True)
        _exit(_EXIT_PEER_FAILED)

    def _fire(self, step: int, thread_id: int) -> None:
        self._exiting.set()
        frame = sys._current_frames().get(thread_id)
        mine = {"waiting": _in_collective(frame), "where": _location(frame)}
        reports: dict[int, dict[str, Any]] = {self._rank: mine}
        prefix = f"hang/{step}/"
        try:
            self._store.set(f"{prefix}{self._rank}", json.dumps(mine))
            reports = self._gather(prefix, [str(r) for r in range(self._world_size)])
        except Exception:  # the store is gone: report what this rank knows
            pass
        stuck = [r for r in range(self._world_size) if not reports.get(r, {}).get("waiting", False)]
        message = _message(step, self._limit_s, reports, stuck, self._world_size)
        if self._rank in stuck and frame is not None:
            _log.error("this rank is stuck here", stack="".join(traceback.format_stack(frame)).rstrip())
        _log.error("step timed out", error=message)
        if self._rank == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):  # rank 0 may host the store: let the others read first
            self._store.set(f"{prefix}read/{self._rank}", "1")
            if self._rank == 0:
                self._gather(prefix, [f"read/{r}" for r in range(self._world_size)])
        _exit(EXIT_STEP_TIMEOUT)

    def _gather(self, prefix: str, names: list[str]) -> dict[int, dict[str, Any]]:
        """The posts under `prefix` that arrive within `REPORT_GRACE_S` (by rank)."""
        deadline = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < deadline and not self._store.check([prefix + n for n in names]):
            time.sleep(0.05)
        found: dict[int, dict[str, Any]] = {}
        for rank, name in enumerate(names):
            if self._store.check([prefix + name]):
                value = self._store.get(prefix + name).decode()
                found[rank] = json.loads(value) if value.startswith("{") else {}
        return found


def _exit(status: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _in_collective(frame: FrameType | None) -> bool:
    """True when one of the innermost Python frames of the thread is torch.distributed code."""
    for _ in range(_INNER_FRAMES):
        if frame is None:
            return False
        if _COLLECTIVE_PATH in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _location(frame: FrameType | None) -> str:
    if frame is None:
        return "unknown"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _message(
    step: int, limit_s: float, reports: dict[int, dict[str, Any]], stuck: list[int], world_size: int
) -> str:
    head = f"step {step} did not finish within trainer.timeouts.step_s={limit_s:g} s"
    tail = "; every rank stopped and the last committed checkpoint stays the latest"
    if not stuck:
        where = ", ".join(f"rank {r} at {reports[r]['where']}" for r in sorted(reports))
        return f"{head}: every rank waits in a collective, so they called different ones ({where}){tail}"
    parts = []
    for rank in stuck:
        if rank in reports:
            parts.append(f"rank {rank} is stuck outside any collective at {reports[rank]['where']}")
        else:
            parts.append(f"rank {rank} did not answer (its process may be frozen)")
    waiting = [r for r in range(world_size) if r not in stuck]
    also = f"; ranks {waiting} wait for it in a collective" if waiting else ""
    return f"{head}: {'; '.join(parts)}{also} (its stack is in its own log){tail}"
