"""The fault guards of a run, started together once the job is built: one job per run directory
(`RunLock`), one report per failure (`FailureBoard`), no silent hang (`StepWatchdog`), and the
test-only fault injection."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from d9d.ckpt import CheckpointManager
from d9d.mesh import DistributedContext
from d9d.trainer.config.trainer import TimeoutsConfig
from d9d.trainer.faults.failures import FailureBoard, job_store
from d9d.trainer.faults.injection import FaultInjection
from d9d.trainer.faults.run_lock import RunLock
from d9d.trainer.faults.watchdog import StepWatchdog

__all__ = ["RunGuards", "guard_run"]


@dataclass(frozen=True)
class RunGuards:
    """The guards of one rank's run (the watchdog is None on one process: no store to watch through)."""

    failures: FailureBoard
    watchdog: StepWatchdog | None
    faults: FaultInjection


def guard_run(
    ctx: DistributedContext,
    timeouts: TimeoutsConfig,
    run_dir: Path,
    manager: CheckpointManager,
    *,
    read_only: bool,
    closers: list[Callable[[], None]],
    releasers: list[Callable[[], None]],
) -> RunGuards:
    """Start the guards; what each holds is appended to `closers` (released before the process group
    closes) and `releasers` (after it: the failure board lingers for the other ranks' reports, and
    only then is the run lock released for the next job) as soon as it is acquired, so a failure
    half-way releases what was got. A `read_only` run (`d9d export`) takes no lock and cleans nothing.
    """
    store = job_store(ctx)
    failures = FailureBoard(store, ctx.rank, ctx.world_size)
    releasers.append(failures.linger)
    if not read_only:
        releasers.append(RunLock.acquire(run_dir, ctx).release)
    if ctx.is_main_process and not read_only:  # no other job writes the run now: clean up
        manager.remove_leftovers()
    watchdog = None
    if store is not None:
        watchdog = StepWatchdog(store, failures, ctx.rank, ctx.world_size, timeouts.step_s,
                                dump_dir=run_dir / "hangs")  # fmt: skip
        closers.append(watchdog.close)
    return RunGuards(failures=failures, watchdog=watchdog, faults=FaultInjection.from_env(ctx.rank))
