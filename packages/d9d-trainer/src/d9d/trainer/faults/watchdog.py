"""`StepWatchdog`: a hung or failed rank stops every rank of the job, with one clear report.

Each rank runs a watchdog thread while it trains. It polls the job's `FailureBoard`: when another
rank recorded a failure, this rank (blocked in a collective with it, most likely) stops at once with
exit status 2, rank 0 printing that rank's error. When this rank's step passes
`trainer.timeouts.step_s`, the thread posts to the job's store how many collectives this rank issued
on each of its process groups (torch's per-group sequence numbers) and whether its training thread
sits in torch.distributed code, reads the others' posts for a moment, logs an error naming the stuck
ranks (the stuck rank also logs its stack), writes torch's flight-recorder trace of this rank, and
exits with `EXIT_STEP_TIMEOUT`.

A rank that issued fewer collectives on a group than its peers is the stuck one: this holds for NCCL,
whose collectives return at once (a rank waiting for a peer sits in `.item()` or a sync, not in a
collective), as for gloo. With equal counts, gloo ranks blocked in a collective are waiting and the
others are stuck; NCCL ranks that all sit outside collectives wait for a collective that does not
complete on the GPUs, which the flight-recorder dumps show. Both exits happen from the thread: a
blocked or hung rank may never return to Python, so raising would not be enough (the NCCL watchdog
aborts likewise). A checkpoint being written at that moment stays uncommitted.
"""

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from d9d.mesh import get_logger
from d9d.trainer._torch_compat import dump_fr_trace
from d9d.trainer.faults.failures import FailureBoard

__all__ = ["EXIT_STEP_TIMEOUT", "FLIGHT_RECORDER_DIR", "REPORT_GRACE_S", "StepWatchdog", "issued_collectives"]

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
#: Where the flight-recorder traces go unless the trainer names a folder (`dump_dir`).
FLIGHT_RECORDER_DIR = Path(tempfile.gettempdir()) / "d9d-flight-recorder"
#: How long writing this rank's flight-recorder trace may take before the report goes without it.
_DUMP_LIMIT_S = 2.0
#: Ranks of a group named in a report before they are only counted.
_NAMED_RANKS = 4
_log = get_logger("d9d.trainer")


class StepWatchdog:
    """Watches the steps of one rank; `with watchdog.step(n):` arms it for the duration of step n."""

    def __init__(
        self,
        store: dist.Store,
        failures: FailureBoard,
        rank: int,
        world_size: int,
        limit_s: float,
        *,
        dump_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Start the thread.

        Args:
            dump_dir: folder for the flight-recorder traces of a hang (`FLIGHT_RECORDER_DIR` if None);
                each rank writes `step-<n>-<backend>/rank_<rank>` there, on its own node.
        """
        self._store = store
        self._dump_dir = Path(dump_dir) if dump_dir is not None else FLIGHT_RECORDER_DIR
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
        mine: dict[str, Any] = {"waiting": _in_collective(frame), "where": _location(frame)}
        with contextlib.suppress(Exception):  # a report without counts still names the stuck rank
            mine["issued"], mine["nccl"] = issued_collectives()
        reports: dict[int, dict[str, Any]] = {self._rank: mine}
        prefix = f"hang/{step}/"
        try:
            self._store.set(f"{prefix}{self._rank}", json.dumps(mine))
            reports = self._gather(prefix, [str(r) for r in range(self._world_size)])
        except Exception:  # the store is gone: report what this rank knows
            pass
        dumps = _dump_flight_recorder(self._dump_dir, step, self._rank)
        stuck, behind = _stuck_ranks(reports, self._world_size)
        message = _message(step, self._limit_s, reports, stuck, self._world_size, behind=behind, dumps=dumps)
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


def issued_collectives() -> tuple[dict[str, list[Any]], bool]:
    """How many collectives this process issued on each of its groups, and whether any group runs NCCL.

    Returns `{"<group name>/<backend>": [count, description]}` over every group of more than one
    rank that this process belongs to. The counts are torch's per-group sequence numbers: bumped when a
    collective is issued (not when it completes), so equal on every member of a group at a step
    boundary, and lower on a rank that stopped issuing.
    """
    issued: dict[str, list[Any]] = {}
    nccl = False
    for group, name, backend in _group_backends():
        nccl = nccl or "nccl" in name
        if group.size() < 2:
            continue
        count = int(backend._get_sequence_number_for_group())
        issued[f"{group.group_name}/{name}"] = [count, group.group_desc]
    return issued, nccl


def _group_backends() -> list[tuple[dist.ProcessGroup, str, Any]]:
    """(group, backend name, backend) for every group this process belongs to, each backend once."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    found = []
    # torch keeps no public list of groups; `_world.pg_names` holds exactly this process's groups
    for group in list(c10d._world.pg_names):
        seen: set[str] = set()
        for device in group._device_types:
            backend = group._get_backend(device)
            name = backend.name()
            if name not in seen:  # gloo serves cpu and cuda with one backend
                seen.add(name)
                found.append((group, name, backend))
    return found


def _stuck_ranks(
    reports: dict[int, dict[str, Any]], world_size: int
) -> tuple[list[int], dict[int, list[str]]]:
    """The stuck ranks, and for those behind their peers on some group, how far (one phrase a group)."""
    silent = [r for r in range(world_size) if r not in reports]
    behind: dict[int, list[str]] = {}
    groups: dict[str, dict[int, int]] = {}
    described: dict[str, tuple[str, str]] = {}
    for rank, report in reports.items():
        for key, (count, desc, *_) in (report.get("issued") or {}).items():
            groups.setdefault(key, {})[rank] = int(count)
            described[key] = (str(desc), key.rsplit("/", 1)[-1])
    for key, counts in sorted(groups.items()):
        most = max(counts.values())
        ahead = sorted(r for r, c in counts.items() if c == most)
        desc, backend = described[key]
        for rank, count in sorted(counts.items()):
            if count < most:
                behind.setdefault(rank, []).append(
                    f"it issued {count} collectives on {desc} ({backend}) where {_ranks_phrase(ahead)} "
                    f"issued {most}"
                )
    if behind:
        return sorted(set(behind) | set(silent)), behind
    outside = [r for r, report in reports.items() if not report.get("waiting", False)]
    if reports and len(outside) == len(reports) and any(rep.get("nccl") for rep in reports.values()):
        return silent, behind  # NCCL: everyone issued the same and waits on the GPU (see _message)
    return sorted(set(outside) | set(silent)), behind


def _ranks_phrase(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= _NAMED_RANKS:
        return f"ranks {ranks}"
    return f"{len(ranks)} ranks"


def _dump_flight_recorder(folder: Path, step: int, rank: int) -> list[str]:
    """Write this rank's flight-recorder trace per backend; the folders written to (none when it is off)."""
    written: list[str] = []

    def dump(name: str) -> None:
        import torch._C._distributed_c10d as c10d_ext

        if "nccl" in name and hasattr(c10d_ext, "_dump_nccl_trace"):
            data = c10d_ext._dump_nccl_trace(includeCollectives=True, includeStackTraces=False)
        else:
            data = dump_fr_trace(name)
        if data:
            target = folder / f"step-{step}-{name}"
            target.mkdir(parents=True, exist_ok=True)
            (target / f"rank_{rank}").write_bytes(data)
            written.append(str(target))

    def quiet() -> None:
        for name in sorted({name for _, name, _ in _group_backends()}):
            with contextlib.suppress(Exception):  # no trace is no reason to lose the report
                dump(name)

    worker = threading.Thread(target=quiet, name="d9d-flight-recorder-dump", daemon=True)
    worker.start()
    worker.join(_DUMP_LIMIT_S)  # a wedged communicator must not hold the report back
    return list(written)


def _message(
    step: int,
    limit_s: float,
    reports: dict[int, dict[str, Any]],
    stuck: list[int],
    world_size: int,
    *,
    behind: dict[int, list[str]] | None = None,
    dumps: list[str] | None = None,
) -> str:
    head = f"step {step} did not finish within trainer.timeouts.step_s={limit_s:g} s"
    tail = "; every rank stopped and the last committed checkpoint stays the latest"
    if dumps:
        tail = (
            f"; flight-recorder traces: {', '.join(dumps)} (each rank writes its own there, on its node; "
            f"read NCCL ones with `python -m torch.distributed.flight_recorder.fr_trace <folder>`){tail}"
        )
    behind = behind or {}
    if not stuck:
        where = ", ".join(f"rank {r} at {reports[r]['where']}" for r in sorted(reports))
        if all(report.get("waiting", False) for report in reports.values()):
            return f"{head}: every rank waits in a collective, so they called different ones ({where}){tail}"
        return (
            f"{head}: every rank issued the same collectives and waits for them to finish ({where}): a "
            "collective does not complete on the GPUs (ranks that called it with different shapes or "
            f"in a different order, or a broken NCCL link){tail}"
        )
    parts = []
    for rank in stuck:
        if rank not in reports:
            parts.append(f"rank {rank} did not answer (its process may be frozen)")
            continue
        report = reports[rank]
        if report.get("waiting", False):
            text = f"rank {rank} waits in a collective at {report['where']} but is behind"
        else:
            text = f"rank {rank} is stuck outside any collective at {report['where']}"
        if rank in behind:
            text += ": " + "; ".join(behind[rank][:2])
        parts.append(text)
    waiting = [r for r in range(world_size) if r not in stuck]
    also = f"; ranks {waiting} wait for it in a collective" if waiting else ""
    return f"{head}: {'; '.join(parts)}{also} (its stack is in its own log){tail}"
