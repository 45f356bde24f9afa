"""The GPU check's plan and its runner: which checks run, in which order, under which share of the budget.

    python benchmarks/gpu_check_run.py          # what benchmarks/gpu_check.sh runs, after the wheels

Headline first: versions and peak; the throughput phases at the 8B shape (the plain PyTorch loop, then
d9d bf16, + compile, + compile + float8, + full activation checkpointing); MoE grouped vs loop at a
realistic shape; host syncs per step; then the correctness checks. Each check runs in its own process
and prints one `RESULT <check> PASS|FAIL|INFO <details>` line; the runner copies it into the summary.

Every check has a weight (`Check.weight`): its share of `BUDGET_S` is weight / total weight, and it must
end by the time the shares up to and including its own are spent. So the limits add up to the budget,
time a check leaves unused passes to the next, and a slow check never eats the share of a later one.
Checks of weight 0 run only on what the others left. A check whose time is gone is not started and
says so (`SKIP out of budget`); one stopped at its limit says so (`FAIL out of budget`). The summary
has one line per check whatever happens, a SIGTERM included. Standard library only: it runs before
anything is known to import.

Environment: OUT (summary.txt, logs.tgz), DEVICE (cuda | cpu: tiny shapes), BUDGET_S (540 on cuda),
SKIP ("name ..." to leave out), PY (the Python of the checks).
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
#: A check is not started with less than this many seconds left of its share.
MIN_LIMIT_S = 10
#: What the runner keeps for itself after the checks: the summary and the logs' archive.
RESERVE_S = 5
#: logs.tgz comes back from a lent machine only under 16 MiB; above this the traces are left out.
MAX_LOGS_BYTES = 15 * 2**20


@dataclass(frozen=True)
class Check:
    """One line of the summary: the command that prints it and its weight in the budget."""

    name: str
    weight: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def plan(py: str, device: str, work: Path) -> list[Check]:
    """The checks in the order they run; `work` is the folder the checks share (results, runs, logs)."""
    cuda = device == "cuda"
    check = (py, "benchmarks/gpu_check.py")
    shape = ("--device", "cuda", "--steps", "8", "--warmup", "3") if cuda else ("--tiny",)
    results = ("--results", str(work / "throughput"))

    def phase(name: str, weight: int, phase: str) -> Check:
        return Check(
            name,
            weight,
            (py, "benchmarks/gpu_throughput.py", *shape, *results, "--phases", phase, "--check", name),
        )

    moe_shape = ("--device", "cuda", "--experts", "64", "--top-k", "8", "--tokens", "8192", "--hidden", "2048",
                 "--ffn", "1408") if cuda else ("--tiny",)  # fmt: skip
    compiled = (("TORCH_LOGS", "graph_breaks,recompiles"),)
    return [
        Check("env", 20, (*check, "env")),  # a cold machine's first `import torch` included
        phase("tp_plain", 40, "plain-bf16"),
        phase("tp_bf16", 40, "bf16"),
        phase("tp_compile", 90, "bf16+compile"),
        phase("tp_float8", 95, "bf16+compile+float8"),
        phase("tp_full_ac", 40, "bf16+full-ac"),
        Check("moe", 25, (py, "benchmarks/moe.py", *moe_shape, "--uneven", "--check", "moe")),
        Check("syncs", 25, (*check, "syncs")),
        Check("quickstart", 40, (*check, "quickstart", str(work / "runs"))),
        Check("dtypes", 15, (*check, "dtypes")),
        Check("cp_attention", 15, (*check, "cp")),
        Check("flex_docmask", 35, (*check, "flex")),
        Check("fsdp", 30, (*check, "fsdp")),
        Check("cpu_offload", 25, (*check, "cpu_offload")),
        Check("fsdp_compiled", 0, (*check, "fsdp_compiled"), compiled),
        Check("moe_compile", 0, (*check, "moe_compile", str(work / "runs")), compiled),
    ]


def deadlines(checks: list[Check], start: float, budget_s: float) -> list[float]:
    """When each check must be done: the start plus the shares of the budget up to and including its own."""
    total = sum(c.weight for c in checks) or 1
    usable = budget_s - RESERVE_S
    spent, out = 0, []
    for c in checks:
        spent += c.weight
        out.append(start + usable * spent / total)
    return out


def result_line(name: str, log: str, returncode: int, took: float) -> str:
    """The summary line of a check that ran: its own RESULT line, or one made from its exit status."""
    own = [line for line in log.splitlines() if line.startswith(f"RESULT {name} ")]
    tail = " ".join(log[-300:].split())
    if own:
        line = f"{own[-1]}  [{took:.0f}s]"
        return (
            line
            if returncode == 0
            else f"RESULT {name} FAIL exit {returncode} after: {line[len(name) + 8 :]}"
        )
    if returncode == 0:
        return f"RESULT {name} PASS [{took:.0f}s]"
    return f"RESULT {name} FAIL exit {returncode} [{took:.0f}s]: {tail}"


class _Stopped(Exception):
    """The runner got SIGTERM or SIGINT: the checks left get their lines, then it ends."""


def _stop(signum: int, frame: object) -> None:
    raise _Stopped(signal.Signals(signum).name)


def _run_one(check: Check, limit: float, logs: Path) -> str:
    env = dict(os.environ, **dict(check.env))
    log_path = logs / f"{check.name}.log"
    began = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(check.argv)}  (limit {limit:.0f} s)\n")
        log.flush()
        process = subprocess.Popen(check.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill(process)
            return f"RESULT {check.name} FAIL out of budget: stopped at its limit of {limit:.0f} s"
        except _Stopped:
            _kill(process)
            raise
    return result_line(check.name, log_path.read_text(errors="replace"), returncode, time.monotonic() - began)


def _kill(process: subprocess.Popen) -> None:
    """End the check and everything it started (its own session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run(checks: list[Check], budget_s: float, skip: set[str], summary: Path, logs: Path) -> int:
    """Run `checks` in order within `budget_s`; one summary line each. Returns 1 if a line is FAIL."""
    start = time.monotonic()
    lines: list[str] = []

    def note(line: str) -> None:
        lines.append(line)
        print(line, flush=True)
        with open(summary, "a") as f:
            f.write(line + "\n")

    summary.write_text("")
    ends = deadlines(checks, start, budget_s)
    running: str | None = None
    try:
        for check, end in zip(checks, ends, strict=True):
            left = end - time.monotonic() - 2  # the kill's grace
            if check.name in skip:
                note(f"RESULT {check.name} SKIP (SKIP)")
            elif left < MIN_LIMIT_S:
                note(
                    f"RESULT {check.name} SKIP out of budget: {max(left, 0):.0f} s left of BUDGET_S={budget_s:.0f}"
                )
            else:
                running = check.name
                line = _run_one(check, left, logs)
                running = None
                note(line)
    except _Stopped as stop:
        if running is not None:
            note(f"RESULT {running} FAIL stopped by {stop}")
        reported = {line.split()[1] for line in lines}
        for check in checks:
            if check.name not in reported:
                note(f"RESULT {check.name} SKIP stopped by {stop} before it ran")
    took = time.monotonic() - start
    print(f"==== summary ({took:.0f} s of BUDGET_S={budget_s:.0f}) ====")
    print("\n".join(lines), flush=True)
    return 1 if any(line.split()[2] == "FAIL" for line in lines) else 0


def archive(logs: Path, out: Path) -> None:
    """`out`: the logs as a .tgz, without the profiler traces if it would pass MAX_LOGS_BYTES."""
    for leave_out in ((), ("profile",)):
        with tarfile.open(out, "w:gz") as tar:
            tar.add(logs, arcname="logs", filter=lambda t, out=leave_out: None if _under(t.name, out) else t)
        if out.stat().st_size <= MAX_LOGS_BYTES:
            return


def _under(name: str, folders: tuple[str, ...]) -> bool:
    return any(re.search(rf"(^|/){re.escape(f)}(/|$)", name) for f in folders)


def _refuse(line: str) -> NoReturn:
    print(line, file=sys.stderr)
    raise SystemExit(2)


def _settings() -> tuple[str, float, set[str]]:
    """DEVICE, BUDGET_S and SKIP from the environment, checked before anything is written.

    Raises:
        SystemExit: status 2, after one line naming the variable, what it holds and what it takes.
    """
    device = os.environ.get("DEVICE", "cuda")
    if device not in ("cuda", "cpu"):
        _refuse(f"error: DEVICE={device!r}: set it to cuda (the GPU) or cpu (a dry run at tiny shapes)")
    raw = os.environ.get("BUDGET_S") or ("540" if device == "cuda" else "1500")
    try:
        budget = float(raw)
    except ValueError:
        _refuse(f"error: BUDGET_S={raw!r}: set it to the run's seconds, e.g. BUDGET_S=540")
    skip = set(os.environ.get("SKIP", "").split())
    names = [c.name for c in plan("python3", device, Path("work"))]
    if skip - set(names):
        unknown = " ".join(sorted(skip - set(names)))
        _refuse(f"error: SKIP names no check: {unknown}; the checks are {' '.join(names)}")
    return device, budget, skip


def main() -> int:
    device, budget, skip = _settings()
    out = Path(os.environ.get("OUT") or "/tmp/d9d-gpu-check")
    out = out if out.is_absolute() else ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="d9d-gpu-check."))
    logs = work / "logs"
    logs.mkdir()
    os.environ["D9D_GPU_CHECK_LOGS"] = str(logs)  # where a check leaves its traces
    checks = plan(os.environ.get("PY") or sys.executable, device, work)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        return run(checks, budget, skip, out / "summary.txt", logs)
    finally:
        archive(logs, out / "logs.tgz")


if __name__ == "__main__":
    sys.exit(main())
