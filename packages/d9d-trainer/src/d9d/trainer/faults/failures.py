"""`FailureBoard`: when a rank fails, the job stops with that rank's error, reported once.

Every rank of a job shares the key-value store of the default process group. The first rank that
fails writes its error there (`compare_set`: the first writer wins) and logs its traceback. The
other ranks are usually blocked in a collective with it: their step watchdog threads poll the record
and stop them (see `d9d.trainer.faults.watchdog`); a rank whose collective breaks first finds the record too
and raises a `PeerFailedError` with the same message. Either way rank 0 prints that message (the
CLI's rule), so the `error:` line appears once instead of N copies of a collective error. In local
mode there is nothing to coordinate and errors pass unchanged.
"""

import datetime
import json
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import torch.distributed as dist

from d9d.mesh import D9dError, DistributedContext, get_logger
from d9d.trainer.errors import ErrorVerdict, PeerFailedError, TrainingError, attach_verdict, verdict_of

__all__ = [
    "ErrorVerdict",
    "FailureBoard",
    "agree_on_error",
    "error_store",
    "job_store",
    "mark_own_error",
    "verdict_of",
]

_FAILURE_KEY = "failure"
#: How long a stopping rank waits for the others to stop too, so that rank 0 prints the report
#: before a launcher (torchrun) reacts to the first exit by killing the rest.
_LINGER_S = 5.0
#: How long a failed rank waits for the others to post their errors before it decides alone.
AGREE_WINDOW_S = 5.0
_log = get_logger("d9d.trainer")


def job_store(context: DistributedContext) -> dist.Store | None:
    """A store namespace of this launch alone (collective), or None in local mode.

    The default group's store outlives restarts under `torchrun --max-restarts`, so the namespace is
    a fresh id from rank 0.
    """
    if context.mode != "distributed":
        return None
    box = [uuid.uuid4().hex[:12] if context.is_main_process else None]
    dist.broadcast_object_list(box, src=0)
    return dist.PrefixStore(f"d9d/{box[0]}/", dist.distributed_c10d._get_default_store())


class FailureBoard:
    """Where the ranks of one launch tell each other which rank failed first, and why."""

    def __init__(self, store: dist.Store | None, rank: int, world_size: int) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._stopping = False

    def first_failure(self) -> tuple[int, str] | None:
        """(rank, message) of the first rank that failed, or None while none did."""
        if self._store is None or not self._store.check([_FAILURE_KEY]):
            return None
        record = json.loads(self._store.get(_FAILURE_KEY))
        return int(record["rank"]), str(record["message"])

    def stopping(self, exc: Exception, step: int) -> Exception:
        """The error this rank stops with after `exc` in `step`: its own, or the first failed rank's.

        The own error of the first rank stays a D9dError as is; any other exception becomes a
        one-line `TrainingError` (its traceback is logged here, on the failing rank).
        """
        if self._store is None:
            return exc
        self._stopping = True
        message = _message(exc, self._rank, step)
        mine = json.dumps({"rank": self._rank, "message": message})
        try:
            record: dict[str, Any] = json.loads(self._store.compare_set(_FAILURE_KEY, "", mine))
        except Exception:  # the store is gone with its host (rank 0 outside torchrun): report our own
            record = {"rank": self._rank, "message": message}
        # The record is the ranks' agreement on the error: rank 0 reports it (its step watchdog does
        # so too when it stops this rank for a peer), the others stay quiet.
        if record["rank"] != self._rank:
            _log.warning("stopping: another rank failed first", failed_rank=record["rank"], step=step)
            return _mark(PeerFailedError(record["message"], rank=int(record["rank"])), "shared")
        if isinstance(exc, D9dError):
            return _mark(exc, "shared")
        _log.error("step failed", step=step, exc_info=exc)
        return _mark(TrainingError(message), "shared")

    def linger(self, *, stopping: bool = False) -> None:
        """After a failure: wait (briefly) until every rank stopped, then return so the process can exit.

        The failed rank keeps its process (and its connections) alive meanwhile, so the others learn
        of the failure from the record, not from a broken connection, and rank 0 prints it first.
        Rank 0 leaves last: outside torchrun it hosts the store the others still read.
        """
        if self._store is None or not (self._stopping or stopping):
            return
        try:
            self._store.set(f"stopped/{self._rank}", "1")
            self._wait([f"stopped/{r}" for r in range(self._world_size)], _LINGER_S)
            self._store.set(f"left/{self._rank}", "1")  # this rank's last word to the store
            if self._rank == 0:
                self._wait([f"left/{r}" for r in range(self._world_size)], 2.0)
        except Exception:  # the store's host exited: everyone else is stopping already
            return
        if self._rank != 0:
            time.sleep(0.3)  # let rank 0 print the report before a launcher sees this rank exit

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        assert self._store is not None
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)


def _message(exc: Exception, rank: int, step: int) -> str:
    if isinstance(exc, D9dError):
        return " ".join(str(exc).split())
    what = " ".join(f"{type(exc).__name__}: {exc}".split())
    if _is_collective_error(exc):
        return (
            f"rank {rank} lost contact with another rank in step {step} ({what}); that rank probably "
            "died without a report (killed, out of memory, crashed): check the launcher's report"
        )
    return f"rank {rank} failed in step {step}: {what} (traceback in rank {rank}'s log)"


def _is_collective_error(exc: Exception) -> bool:
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        marker in text for marker in ("gloo", "Connection reset", "Connection closed", "NCCL")
    )


# ---------------------------------------------------------------------- one report per error


def mark_own_error(exc: Exception, rank: int) -> None:
    """Record that `exc` is this rank's own error, for it to report (no store to agree through)."""
    _mark(exc, "mine", rank)


def _mark(exc: Exception, kind: Literal["shared", "mine", "peer"], origin: int | None = None) -> Any:
    attach_verdict(exc, ErrorVerdict(kind, origin))
    return exc


def error_store(environ: Mapping[str, str] | None = None) -> dist.Store | None:
    """A store that every rank of this launch reaches even after its process group is gone, or None.

    Under torchrun it is the agent's store (alive for the whole attempt, whatever a rank did), in the
    namespace of this attempt; otherwise the default process group's store while it exists.
    """
    env = os.environ if environ is None else environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        try:
            store = dist.TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=10),
                wait_for_workers=False,
            )
        except Exception:  # the agent is gone: nobody to agree with
            return None
        return dist.PrefixStore(f"d9d-attempt-{attempt}/d9d-errors/", store)
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.PrefixStore("d9d-errors/", dist.distributed_c10d._get_default_store())
        except Exception:
            return None
    return None


def agree_on_error(
    exc: Exception,
    store: dist.Store,
    rank: int,
    world_size: int,
    *,
    window_s: float = AGREE_WINDOW_S,
) -> ErrorVerdict:
    """Compare this rank's error text with the other ranks' through `store`; attach and return the verdict.

    Every failed rank posts its one-line text. When all `world_size` ranks posted the same text, the
    error is shared (a bad config, the same missing file everywhere): rank 0 reports it. Otherwise
    the first rank whose error is its own (not a broken collective or a relayed peer failure)
    reports it, naming its rank; the others stay quiet. Ranks that are still busy (blocked in a
    collective with the failed rank) are waited for up to `window_s` seconds.
    """
    text = " ".join(str(exc).split()) or type(exc).__name__
    consequence = isinstance(exc, PeerFailedError) or (
        not isinstance(exc, D9dError) and _is_collective_error(exc)
    )
    keys = [f"error/{r}" for r in range(world_size)]
    try:
        seq = store.add("seq", 1)
        store.set(keys[rank], json.dumps({"seq": seq, "text": text, "consequence": consequence}))
        deadline = time.monotonic() + window_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        posted = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
    except Exception:  # the store went away mid-way: this rank can only speak for itself
        posted = {rank: {"seq": 0, "text": text, "consequence": consequence}}
    if len(posted) == world_size and len({p["text"] for p in posted.values()}) == 1:
        verdict = ErrorVerdict("shared")
    else:
        origin = min(posted, key=lambda r: (posted[r]["consequence"], posted[r]["seq"]))
        verdict = ErrorVerdict("mine" if origin == rank else "peer", origin)
        if origin != rank:
            _log.warning("stopping: another rank failed first", failed_rank=origin, error=text)
    attach_verdict(exc, verdict)
    return verdict
