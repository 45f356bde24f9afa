"""Stragglers in a running job: each rank's busy time per step, and a warning for a rank that stays slow.

Under FSDP, tensor or pipeline parallelism every collective waits for its slowest rank, so every
rank's step takes as long as the straggler's: the wall time of a step cannot tell which rank holds
the others up. What can is the time a rank spends *not* waiting in a collective. `BusyClock` counts
it: from the start of the step to its sync, minus the time the host was blocked in `Work.wait`
(every blocking c10d collective, FSDP2's all-gathers and reduce-scatters, pipeline sends and
receives) and in the functional collectives' `wait_tensor` (DTensor redistributions under TP).

The step's one existing sync (`d9d.trainer.step.base`) all-gathers each rank's busy time along with
the stop and save requests, so it costs no extra collective; the records read the gathered times when
they flush and record `straggler_rank` (the busiest rank), `straggler_time_s` (its busy time) and
`straggler_ratio` (that over the median of all ranks). `StragglerWatch` warns once when the same rank
stays above `trainer.logging.stragglers.ratio` for `steps` steps in a row, and once when it catches up.

On CUDA the host does not wait for NCCL (a collective's wait is a stream dependency), so busy time is
the host's: it catches a slow data loader, a busy CPU or a node's Python overhead, not a slow GPU
(`d9d preflight` compares the GPUs' matmul speed). Compiled regions' waits are inside their graphs
and count as busy (the timing steps aside while dynamo traces), as do other threads' waits.
"""

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from d9d.mesh import get_logger

__all__ = ["STRAGGLER_FIELDS", "BusyClock", "StragglerWatch", "straggler_fields"]

_log = get_logger("d9d.trainer")

#: The fields each step record gets on a run of several ranks.
STRAGGLER_FIELDS = ("straggler_rank", "straggler_time_s", "straggler_ratio")

_lock = threading.Lock()
_clocks: list["BusyClock"] = []
_originals: dict[str, Any] = {}


def _timed(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced into a graph: the plain wait, nothing timed
            return original(*args, **kwargs)
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            blocked = time.perf_counter() - start
            thread = threading.get_ident()
            for clock in _clocks:
                if clock._thread == thread:  # the loop's own waits (not a background save's)
                    clock._waited += blocked

    return wait


def _install(clock: "BusyClock") -> None:
    with _lock:
        if not _clocks:
            work = dist.distributed_c10d.Work
            _originals["work_wait"] = work.wait
            _originals["wait_tensor"] = funcol.wait_tensor
            work.wait = _timed(work.wait)  # type: ignore[method-assign]
            funcol.wait_tensor = _timed(funcol.wait_tensor)
        _clocks.append(clock)


def _uninstall(clock: "BusyClock") -> None:
    with _lock:
        _clocks.remove(clock)
        if not _clocks:
            dist.distributed_c10d.Work.wait = _originals.pop("work_wait")  # type: ignore[method-assign]
            funcol.wait_tensor = _originals.pop("wait_tensor")


class BusyClock:
    """This rank's busy time in the current step: wall time since `start_step()` minus the time the
    host was blocked waiting for a collective (see the module doc). Counts only inside `watching()`."""

    def __init__(self) -> None:
        self._waited = 0.0
        self._start = time.perf_counter()
        self._waited_at_start = 0.0
        self._thread = threading.get_ident()

    @contextlib.contextmanager
    def watching(self) -> Iterator["BusyClock"]:
        """Time collective waits while the block runs (the training loop)."""
        _install(self)
        try:
            yield self
        finally:
            _uninstall(self)

    def start_step(self) -> None:
        """The step begins now (on this thread: the waits of other threads do not count)."""
        self._thread = threading.get_ident()
        self._start = time.perf_counter()
        self._waited_at_start = self._waited

    def busy(self) -> float:
        """Seconds of this step so far not spent waiting in a collective."""
        return max(0.0, time.perf_counter() - self._start - (self._waited - self._waited_at_start))


def straggler_fields(busy: Sequence[float]) -> dict[str, Any]:
    """The record fields of one step from every rank's busy time (index: global rank)."""
    slowest = max(range(len(busy)), key=lambda r: busy[r])
    median = statistics.median(busy)
    ratio = busy[slowest] / median if median > 0 else 1.0
    return {"straggler_rank": slowest, "straggler_time_s": busy[slowest], "straggler_ratio": ratio}


@dataclass
class StragglerWatch:
    """Warns when one rank's busy time stays above `ratio` × the median for `steps` steps in a row.

    `describe(rank)`: how the warning names a rank (e.g. its mesh coordinates).
    """

    ratio: float
    steps: int
    describe: Callable[[int], str] = str
    _rank: int | None = None
    _run: int = 0
    _warned: bool = False

    def observe(self, record: dict[str, Any]) -> None:
        """Count the step of `record` (its `STRAGGLER_FIELDS`); log when a streak reaches `steps`."""
        rank, ratio = record["straggler_rank"], record["straggler_ratio"]
        slow = rank if ratio >= self.ratio else None  # the rank this step counts for, if any
        if slow != self._rank:  # the streak ends (or another rank's begins)
            if self._warned:
                _log.info("straggler caught up", rank=self._rank, step=record["step"], ratio=round(ratio, 2))
            self._rank, self._run, self._warned = slow, 0, False
        if slow is None:
            return
        self._run += 1
        if self._run == self.steps and not self._warned:
            self._warned = True
            _log.warning(
                "straggler",
                rank=rank,
                where=self.describe(rank),
                steps=self._run,
                step=record["step"],
                ratio=round(ratio, 2),
                busy_s=round(record["straggler_time_s"], 4),
                hint="this rank computes longer than the median rank every step; check its node "
                "(load, data loading, clocks) or run d9d preflight",
            )
