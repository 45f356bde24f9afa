"""Start quickstart jobs as real processes forked from the test process, and read what they left.

A forked job skips the ~5 s of a fresh interpreter (torch is already imported here), so a fault test
can afford dozens of real kills. Each job writes its stdout and stderr to its own log file. Ranks of
a multi-process job are forked alike and meet through the env:// rendezvous (rank 0 hosts the store),
exactly as under torchrun but without its agent, so every rank's own exit can be observed.
"""

import json
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _quickstart import CONFIG, overrides

from d9d.ckpt.checkpoint.layout import list_checkpoints
from d9d.mesh.testing import free_port

__all__ = [
    "STEPS",
    "Job",
    "committed_steps",
    "job_args",
    "kill_after_save_and_resume",
    "losses",
    "preload_distributed",
    "start_job",
    "start_ranks",
    "step_dirs",
    "wait_for",
]

#: Steps of every faulted run: checkpoints every 2 steps, 2 kept, so the saves of 6 and 8 prune one.
STEPS = 8

_FORK = multiprocessing.get_context("fork")
_STEP_LINE = re.compile(r"d9d\.trainer: step\s+step=(\d+)\b")


def job_args(save_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    """The tiny quickstart (period 2, keep 2) with its run under save_dir/name and an export dir."""
    return overrides(
        save_dir,
        name,
        steps,
        "trainer.checkpointing.num_to_keep=2",
        "trainer.logging.progress_bar=false",
        f"export.dir={save_dir / (name + '-export')}",
        *extra,
    )


@dataclass
class Job:
    """One forked job process and its log."""

    process: multiprocessing.process.BaseProcess
    log: Path
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def poll(self) -> int | None:
        """The exit status once the process ended (negative: killed by that signal), else None."""
        code = self.process.exitcode
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for the exit status; kill the job and fail after `timeout` seconds."""
        self.process.join(timeout)
        code = self.poll()
        if code is None:
            self.kill()
            raise AssertionError(f"job did not finish within {timeout} s:\n{self.output()[-3000:]}")
        return code

    def kill(self) -> None:
        """SIGKILL the job and reap it."""
        if self.process.pid is not None and self.process.exitcode is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)
        self.poll()

    def output(self) -> str:
        """Everything the job printed so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def last_step(self) -> int:
        """The last step the job logged as done (0 before the first)."""
        found = _STEP_LINE.findall(self.output())
        return int(found[-1]) if found else 0


def start_job(
    args: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    setup: Callable[[], None] | None = None,
    *,
    config: str | Path = CONFIG,
) -> Job:
    """Fork `python train.py CONFIG ARGS` (`d9d.trainer.main`; CONFIG: the quickstart's unless given)
    with `env` added.

    `setup` runs in the child first (e.g. to make its disk writes fail).
    """
    process = _FORK.Process(
        target=_job_main, args=(str(config), list(args), str(log), dict(env or {}), setup), daemon=True
    )
    process.start()
    return Job(process, log)


def preload_distributed() -> None:
    """Import here, once, what a distributed rank imports (device meshes pull in dynamo, ~6 s)."""
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401


def start_ranks(
    world_size: int,
    args: Sequence[str],
    logs: Path,
    env: Mapping[str, str] | None = None,
    *,
    config: str | Path = CONFIG,
) -> list[Job]:
    """Fork the ranks of one job (env:// rendezvous on a free port); rank r logs to logs/rank-r.txt."""
    port = str(free_port())
    jobs = []
    for rank in range(world_size):
        rank_env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            **(env or {}),
        }
        jobs.append(start_job(args, logs / f"rank-{rank}.txt", rank_env, config=config))
    return jobs


def wait_for(condition: Callable[[], bool], job: Job, timeout: float = 60.0, what: str = "") -> bool:
    """Poll `condition` until true (True) or the job ended first (False); fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None:
            return condition()
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"timed out waiting for {what}:\n{job.output()[-3000:]}")
        time.sleep(0.005)
    return True


def kill_after_save_and_resume(
    run_dir: Path,
    args: Sequence[str],
    steps: int,
    *,
    save_step: int = 4,
    config: str | Path = CONFIG,
    killed_env: Mapping[str, str] | None = None,
) -> Job:
    """Run the job (`start_job`), SIGKILL it once `save-<save_step>` exists in `run_dir`, then run it
    again to the end: it must resume. Logs go next to `run_dir` (killed.log, resumed.log); returns the
    resumed job. `killed_env`: added to the first run only (e.g. D9D_TEST_HANG_AT_STEP to hold it
    after the save, for a job whose steps are too quick to kill in between)."""
    logs = run_dir.parent
    job = start_job(args, logs / "killed.log", killed_env, config=config)
    save = run_dir / f"save-{save_step}"
    wait_for(save.exists, job, timeout=240, what=save.name)
    job.kill()
    assert job.poll() == -signal.SIGKILL, "the run ended before its checkpoint"
    assert not (run_dir / f"save-{steps}").exists(), "killed too late to test a resume"
    resumed = start_job(args, logs / "resumed.log", config=config)
    assert resumed.wait(240) == 0, resumed.output()[-3000:]
    assert "resumed" in resumed.output()
    return resumed


def committed_steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints of a run."""
    return [info.step for info in list_checkpoints(run_dir)]


def step_dirs(run_dir: Path) -> list[int]:
    """Steps of every `save-<step>` directory, committed or not."""
    if not run_dir.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in run_dir.iterdir() if re.fullmatch(r"save-\d+", p.name))


def losses(run_dir: Path) -> list[float]:
    """Losses per step from the run's metrics file."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _job_main(
    config: str, args: list[str], log: str, env: dict[str, str], setup: Callable[[], None] | None
) -> None:
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        os.environ.update({"OMP_NUM_THREADS": "1", **env})
        import torch

        torch.set_num_threads(1)
        from d9d.trainer import main

        if setup is not None:
            setup()
        try:
            main([config, *args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
