"""The step-time breakdown: where each step's time went (data wait, forward+backward, optimizer, checkpoint).

The loop and the step strategies only mark phase boundaries on a `StepTimer`; nothing is read until
the records are flushed (`d9d.trainer.observe.records`), which has synced with the device anyway. On CUDA a
mark records a `torch.cuda.Event(enable_timing=True)` on the current stream, so the times are those
of the device timeline and marking costs no host sync. On CPU ops run synchronously, so a mark is
`time.perf_counter()` and exact.

A phase runs from the previous mark (or `begin()`) to its own mark; a phase marked several times
between two `take()`s (a checkpoint after one step, then the next step) adds up. The names are
those of `PHASES`; a record carries `time_<phase>_s` for each of them (0.0 for one not marked).

The same boundaries delimit the profiler's ranges: each timed phase is a `record_function` range
named `d9d.<phase>` (`trace_name`), opened at the mark that starts it and closed at the mark that
ends it, so a trace (`trainer.profiling`) shows exactly the spans the breakdown adds up. The plain
step also puts each microbatch's forward and backward in a `d9d.forward_backward.microbatch_<i>`
range inside it (under pipeline parallelism torch's schedule names its own `Forward i` and
`Backward i`). Outside the profiler a range costs a few microseconds and records nothing.
"""

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.profiler import record_function

__all__ = ["PHASES", "HostEvent", "StepPhases", "StepTimer", "TimingEvent", "read_phases", "trace_name"]

#: The phases of a step, in order, and the checkpoint stall that follows a checkpoint step.
PHASES = ("data", "forward_backward", "optimizer", "checkpoint")
#: The phase a mark starts: the step's phases follow one another; "optimizer" ends the step and
#: "checkpoint" the stall after it.
_FOLLOWS: dict[str, str | None] = {
    "data": "forward_backward",
    "forward_backward": "optimizer",
    "optimizer": None,
    "checkpoint": None,
}


def trace_name(phase: str, microbatch: int | None = None) -> str:
    """The profiler range of `phase` (one of `PHASES`), or of one microbatch's forward and backward."""
    assert phase in PHASES, phase
    return f"d9d.{phase}" if microbatch is None else f"d9d.{phase}.microbatch_{microbatch}"


class TimingEvent(Protocol):
    """A point on a timeline: what `torch.cuda.Event(enable_timing=True)` offers, and `HostEvent`."""

    def record(self) -> None:
        """Mark now (on CUDA: enqueue the mark on the current stream)."""
        ...

    def synchronize(self) -> None:
        """Wait until the mark has happened (free once the device was synced)."""
        ...

    def elapsed_time(self, end_event: "TimingEvent") -> float:
        """Milliseconds from this mark to `end_event`."""
        ...


class HostEvent:
    """A `TimingEvent` on the host clock (`time.perf_counter`): exact where ops run synchronously (CPU)."""

    def __init__(self) -> None:
        self._at = 0.0

    def record(self) -> None:
        """Mark now."""
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: the mark happened when it was recorded."""

    def elapsed_time(self, end_event: "TimingEvent") -> float:
        """Milliseconds from this mark to `end_event` (another `HostEvent`)."""
        assert isinstance(end_event, HostEvent)
        return (end_event._at - self._at) * 1e3


def _cuda_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class StepPhases:
    """The marked phases of one step, unread: (phase, start, end) spans of `TimingEvent`s."""

    spans: tuple[tuple[str, TimingEvent, TimingEvent], ...]

    def seconds(self) -> dict[str, float]:
        """Seconds per phase of `PHASES` (0.0 for one not marked); reads the events (do it after a sync)."""
        totals = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self.spans:
            totals[phase] += start.elapsed_time(end) / 1e3
        return totals

    def record(self) -> dict[str, float]:
        """The record fields: `time_<phase>_s` for every phase."""
        return {f"time_{phase}_s": value for phase, value in self.seconds().items()}


def read_phases(phases: Sequence[StepPhases | None]) -> list[dict[str, float]]:
    """The record fields of several steps' phases (`{}` for None), waiting once on the latest event.

    Called when the records are flushed: the device has been synced, so the wait returns at once.
    """
    last = next((p.spans[-1][2] for p in reversed(phases) if p is not None and p.spans), None)
    if last is not None:
        last.synchronize()
    return [p.record() if p is not None else {} for p in phases]


class StepTimer:
    """Marks phase boundaries with events from `event_factory`; never reads them (see `StepPhases`).

    Marks count only between `begin()` and `take()`, so a step run outside the loop (a benchmark
    calling `TrainStep.run`) marks nothing and keeps no events.

    Args:
        event_factory: a new, unrecorded `TimingEvent` per call (`torch.cuda.Event` on CUDA).
    """

    def __init__(self, event_factory: Callable[[], TimingEvent] = HostEvent) -> None:
        self._new_event = event_factory
        self._current: TimingEvent | None = None
        self._spans: list[tuple[str, TimingEvent, TimingEvent]] = []
        self._range: tuple[str, record_function] | None = None  # the open phase's profiler range

    @classmethod
    def for_device(cls, device: torch.device) -> "StepTimer":
        """CUDA events on a CUDA device, the host clock elsewhere."""
        return cls(_cuda_event if device.type == "cuda" else HostEvent)

    def _event(self) -> TimingEvent:
        event = self._new_event()
        event.record()
        return event

    def begin(self, phase: str = "data") -> None:
        """Start timing: the next phase, `phase` (a step's "data", or "checkpoint"), runs from now."""
        self._close_range()
        self._current = self._event()
        self._open_range(phase)

    def mark(self, phase: str) -> None:
        """End `phase` (one of `PHASES`) now; the next phase runs from here. A no-op before `begin()`."""
        if self._current is None:
            return
        assert phase in PHASES, phase
        self._close_range()
        end = self._event()
        self._spans.append((phase, self._current, end))
        self._current = end
        following = _FOLLOWS[phase]
        if following is not None:
            self._open_range(following)

    def take(self) -> StepPhases:
        """The phases marked since the last `take()`, unread; stops timing until the next `begin()`."""
        self._close_range()
        spans, self._spans, self._current = tuple(self._spans), [], None
        return StepPhases(spans)

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """A profiler range for microbatch `index`'s forward and backward (none before `begin()`)."""
        if self._current is None:
            yield
            return
        with record_function(trace_name("forward_backward", index)):
            yield

    def _open_range(self, phase: str) -> None:
        opened = record_function(trace_name(phase))
        opened.__enter__()
        self._range = (phase, opened)

    def _close_range(self) -> None:
        if self._range is not None:
            _, opened = self._range
            self._range = None
            opened.__exit__(None, None, None)
