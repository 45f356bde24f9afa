"""Profiling chosen steps: a torch.profiler Chrome trace per rank and step, and CUDA memory snapshots.

`trainer.profiling: {start_step, active_steps, dir, memory_snapshot}` profiles steps
`start_step .. start_step + active_steps - 1`. Each rank writes `<dir>/rank-<r>-step-<n>.json.gz`
for every profiled step (open it in Perfetto or chrome://tracing). On CUDA, `memory_snapshot: true`
records the allocator's history from the start of the run and writes `<dir>/rank-<r>-memory.pickle`
after the last profiled step (drag it into pytorch.org/memory_viz); a CUDA out-of-memory error before
that writes the snapshot instead and names it in the error line. (Not run on a GPU yet.)
"""

import contextlib
import gzip
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from d9d.mesh import get_logger

__all__ = ["StepProfiler", "trace_path"]

_log = get_logger("d9d.trainer")


def trace_path(directory: Path, rank: int, step: int) -> Path:
    """Where rank `rank` writes the Chrome trace of step `step`."""
    return directory / f"rank-{rank}-step-{step}.json.gz"


class StepProfiler:
    """Profiles the configured steps of one rank; a no-op for every other step (and when off)."""

    def __init__(self, config: Any, directory: Path | None, rank: int, device: torch.device) -> None:
        """`config`: the `trainer.profiling` section; `directory`: its `dir`, resolved (None: off)."""
        self._rank = rank
        self._device = device
        self._directory = directory
        self._steps = (
            range(config.start_step, config.start_step + config.active_steps)
            if directory is not None and config.active_steps > 0
            else range(0)
        )
        self._snapshot = bool(config.memory_snapshot) and device.type == "cuda" and directory is not None
        self._recording = False
        if self._snapshot:  # from the start: an out-of-memory error in any step dumps what led to it
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self._recording = True

    @property
    def enabled(self) -> bool:
        """Some step will be profiled."""
        return len(self._steps) > 0

    @property
    def snapshot_path(self) -> Path | None:
        """Where this rank's CUDA memory snapshot goes (None when snapshots are off)."""
        if not self._snapshot or self._directory is None:
            return None
        return self._directory / f"rank-{self._rank}-memory.pickle"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run step `step` (1-based) under the profiler if it is one of the profiled steps."""
        if step not in self._steps or self._directory is None:
            yield
            return
        self._directory.mkdir(parents=True, exist_ok=True)
        if self._device.type != "cuda":
            # Kineto (the profiler's C++ collector) prints its stages and a failed GPU probe to stderr
            # on every start and stop; without a GPU none of it says anything. Its level is read when
            # it first starts, so this takes effect here; a KINETO_LOG_LEVEL the user set stays.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True) as prof:
            yield
        path = trace_path(self._directory, self._rank, step)
        _write_gzip_trace(prof, path)
        _log.info("profiled step", step=step, trace=str(path))
        if step == self._steps[-1]:
            self.dump_snapshot()

    def dump_snapshot(self) -> Path | None:
        """Write the CUDA memory snapshot recorded so far (e.g. on an out-of-memory error); its path."""
        path = self.snapshot_path
        if path is None or not self._recording:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        _log.info("memory snapshot", path=str(path))
        return path


def _write_gzip_trace(prof: torch.profiler.profile, path: Path) -> None:
    """The Chrome trace, gzip-compressed, written whole or not at all (temp file + rename)."""
    fd, raw = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".json")
    os.close(fd)
    tmp = Path(raw)
    try:
        prof.export_chrome_trace(str(tmp))
        packed = tmp.with_suffix(".gz")
        with tmp.open("rb") as src, gzip.open(packed, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(packed, 0o644)
        packed.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_suffix(".gz").unlink(missing_ok=True)
