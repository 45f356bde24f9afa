"""`run_preflight`: the checks people run by hand before a big launch, run by every rank of the launch.

Run under the job's own launch (`torchrun ... -m d9d.cli preflight config.yaml`, the same `--set`s),
every rank:

* hashes d9d's source, the job's own Python modules (the provider files and what they import, by
  module name) and torch's version ("code"), and the config with its overrides ("config"); a rank whose hash differs from
  rank 0's fails the check, named with its node;
* writes a probe file beside `trainer.checkpointing.save_dir` (in it, or in its nearest existing
  parent when it does not exist yet) and looks for every other rank's: a rank that does not see them
  all has another file system there (save_dir must be shared); the probes are removed after;
* checks that the file system has room for `num_to_keep` + 1 checkpoints (+ `keep_best.count`), each
  the size of the run's latest checkpoint or, before the first, the plan's estimate (parameters and
  optimizer state of the whole model);
* times all-reduce, all-gather and all-to-all over every mesh axis (`d9d.mesh.measure_axes`) and
  names the groups below their axis's median by more than the threshold, and the ranks they share;
* on CUDA, reads free device memory (against the plan's per-rank estimate), the uncorrected ECC
  error count and the SM clock (through NVML, where `pynvml` is installed), and times a bfloat16
  matmul, naming a rank below the median by more than the threshold.

The job's plan is made on the real ranks first, so a config the trainer refuses fails here, with its
words. Nothing is left on disk.
"""

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import socket
import statistics
import sys
import sysconfig
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from d9d.ckpt import list_checkpoints
from d9d.mesh import (
    CollectiveTiming,
    DistributedContext,
    format_size,
    measure_axes,
    slow_groups,
    suspect_ranks,
)
from d9d.trainer.faults.injection import FaultInjection
from d9d.trainer.job.load import LoadedJob
from d9d.trainer.job.resolve import resolve_job
from d9d.trainer.planning.job_plan import plan_job

__all__ = ["PreflightCheck", "PreflightReport", "format_preflight", "run_preflight", "slow_ranks"]


@dataclass(frozen=True)
class PreflightCheck:
    """One line of the preflight table: what was checked, whether it passed, what was found."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class PreflightReport:
    """Every check of a preflight, the same on every rank.

    Attributes:
        world_size: ranks in the launch.
        nodes: the host name of each rank (index: global rank).
        mesh: the mesh's degrees, as `MeshConfig.describe_degrees()` writes them.
        device: the device type the ranks compute on.
        checks: in the order they ran.
        timings: every rank's collective timings (`d9d.mesh.CollectiveTiming`).
    """

    world_size: int
    nodes: tuple[str, ...]
    mesh: str
    device: str
    checks: tuple[PreflightCheck, ...]
    timings: tuple[CollectiveTiming, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(check.ok for check in self.checks)


@dataclass(frozen=True)
class _RankFacts:
    rank: int
    host: str
    code: str
    config: str
    sees: tuple[int, ...]  # the ranks whose probe files this rank found
    probe_error: str
    free_bytes: int
    device_free: int | None = None
    device_total: int | None = None
    ecc_uncorrected: int | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    matmul_flops: float | None = None
    timings: tuple[CollectiveTiming, ...] = ()


def run_preflight(
    loaded: LoadedJob,
    *,
    nbytes: int | None = None,
    iters: int = 5,
    threshold: float = 0.25,
    environ: Mapping[str, str] | None = None,
) -> PreflightReport:
    """Run every check on this rank of the launch and return the whole table (see the module doc).

    `nbytes`: the buffer of each timed collective (default 64 MiB on CUDA, 4 MiB on CPU); `iters`:
    timed calls of each; `threshold`: how far below the median (0.25: 25%) a group or rank may fall.

    Raises:
        D9dError: the config, the launch or the plan is refused (as `d9d train` refuses it).
    """
    if not 0 < threshold < 1:
        from d9d.trainer.errors import ConfigError

        raise ConfigError(f"--threshold {threshold} is not between 0 and 1 (e.g. 0.25: 25% below the median)")
    env = os.environ if environ is None else environ
    job = resolve_job(loaded)  # imports the providers: their files count as the job's code
    tcfg = loaded.config.trainer
    with DistributedContext.from_env(
        loaded.config.mesh,
        init_timeout=datetime.timedelta(seconds=tcfg.timeouts.init_s),
        device=tcfg.device,
        environ=env,
    ) as ctx:
        plan = plan_job(job, ctx, memory=True)
        memory = plan.memory
        assert memory is not None  # asked for
        checkpoint_bytes = (
            memory.param_bytes + memory.state.optimizer_state_bytes * memory.state.optimizer_states
        )
        faults = FaultInjection.from_env(ctx.rank, env)
        probe_dir = _probe_dir(loaded)
        facts = _gather(ctx, _facts(ctx, loaded, probe_dir, nbytes, iters, faults.slow_collectives))
        rank0 = facts[0]
        checks = [
            _hash_check("code", facts, rank0.code),
            _hash_check("config", facts, rank0.config),
            _shared_check(facts, probe_dir),
            _room_check(loaded, rank0.free_bytes, checkpoint_bytes),
            *_bandwidth_checks(facts, threshold),
        ]
        if ctx.device.type == "cuda":
            checks += _cuda_checks(facts, memory.total, threshold)
        return PreflightReport(
            world_size=ctx.world_size,
            nodes=tuple(f.host for f in facts),
            mesh=loaded.config.mesh.describe_degrees(),
            device=ctx.device.type,
            checks=tuple(checks),
            timings=tuple(t for f in facts for t in f.timings),
        )


def _gather(ctx: DistributedContext, mine: _RankFacts) -> list[_RankFacts]:
    if ctx.is_local:
        return [mine]
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    return every


def _facts(
    ctx: DistributedContext,
    loaded: LoadedJob,
    probe_dir: Path,
    nbytes: int | None,
    iters: int,
    slow_collectives: float,
) -> _RankFacts:
    sees, probe_error = _probe(ctx, probe_dir)
    cuda = ctx.device.type == "cuda"
    size = nbytes if nbytes is not None else (64 if cuda else 4) * 2**20
    pause = (lambda: time.sleep(slow_collectives)) if slow_collectives > 0 else None
    timings = measure_axes(ctx, nbytes=size, iters=iters, before_call=pause)
    extra: dict[str, Any] = _cuda_facts(ctx.device) if cuda else {}
    return _RankFacts(
        rank=ctx.rank,
        host=socket.gethostname(),
        code=code_hash(loaded),
        config=config_hash(loaded),
        sees=sees,
        probe_error=probe_error,
        free_bytes=shutil.disk_usage(probe_dir).free,
        timings=tuple(timings),
        **extra,
    )


def code_hash(loaded: LoadedJob) -> str:
    """A hash of d9d's installed source, the job's own imported Python modules (every module whose
    file is neither d9d's nor the interpreter's or an installed package's, by module name: e.g. the
    provider files and what they import) and torch's version."""
    digest = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    import d9d

    roots = [Path(p).resolve() for p in d9d.__path__]
    files: list[tuple[str, Path]] = []
    for root in roots:
        files += [(f"d9d/{p.relative_to(root)}", p) for p in root.rglob("*.py")]
    paths = sysconfig.get_paths()
    installed = {Path(paths[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path is None or not path.endswith(".py"):
            continue
        resolved = Path(path).resolve()
        if any(resolved.is_relative_to(r) for r in (*roots, *installed)) or not resolved.is_file():
            continue
        files.append((f"job/{name}", resolved))
    for key, path in sorted(set(files)):
        digest.update(key.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def config_hash(loaded: LoadedJob) -> str:
    """A hash of the job's config with its overrides (as a checkpoint stores it)."""
    text = json.dumps(loaded.raw, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _probe_dir(loaded: LoadedJob) -> Path:
    """save_dir, or its nearest existing parent (the file system it will be created on)."""
    path = loaded.paths.run_dir.parent
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(ctx: DistributedContext, probe_dir: Path) -> tuple[tuple[int, ...], str]:
    """(the ranks whose probe files this rank sees in `probe_dir`, this rank's write error or "")."""
    token = [uuid.uuid4().hex if ctx.rank == 0 else None]
    if not ctx.is_local:
        dist.broadcast_object_list(token, src=0)
    mine = probe_dir / f".d9d-preflight-{token[0]}-{ctx.rank}"
    error = ""
    try:
        mine.write_text(socket.gethostname())
    except OSError as exc:
        error = f"cannot write in {probe_dir} ({exc.strerror})"
    try:
        ctx.barrier()
        prefix = f".d9d-preflight-{token[0]}-"
        found = {p.name.removeprefix(prefix) for p in probe_dir.glob(f"{prefix}*")}
        sees = tuple(r for r in range(ctx.world_size) if str(r) in found)
        ctx.barrier()
    finally:
        mine.unlink(missing_ok=True)
    return sees, error


def _cuda_facts(device: torch.device) -> dict[str, Any]:
    free, total = torch.cuda.mem_get_info(device)
    facts: dict[str, Any] = {"device_free": int(free), "device_total": int(total)}
    try:  # NVML through pynvml, where installed: ECC and clocks
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        with contextlib.suppress(pynvml.NVMLError):  # ECC off or not reported on this device
            facts["ecc_uncorrected"] = int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
        facts["sm_clock_mhz"] = int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
        facts["sm_clock_max_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception:  # no NVML here: those figures are "not reported"
        pass
    n = 4096
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b  # warm-up
    torch.cuda.synchronize(device)
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize(device)
    facts["matmul_flops"] = 2 * n**3 * reps / (time.perf_counter() - start)
    return facts


def _where(facts: Sequence[_RankFacts], ranks: Sequence[int]) -> str:
    """`rank 3 (node-b)` / `ranks 2, 3 (node-b)`, every host of those ranks."""
    hosts = ", ".join(dict.fromkeys(facts[r].host for r in ranks))
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(map(str, ranks))} ({hosts})"


def _hash_check(what: str, facts: Sequence[_RankFacts], expected: str) -> PreflightCheck:
    other = [f.rank for f in facts if getattr(f, what) != expected]
    if not other:
        return PreflightCheck(f"same {what}", True, f"{expected} on every rank")
    hashes = ", ".join(sorted({getattr(facts[r], what) for r in other}))
    fix = (
        "install the same d9d, torch and job files on every node"
        if what == "code"
        else "launch every node with the same config file and --set overrides"
    )
    return PreflightCheck(f"same {what}", False, f"{_where(facts, other)} {hashes}, rank 0 {expected}: {fix}")


def _shared_check(facts: Sequence[_RankFacts], probe_dir: Path) -> PreflightCheck:
    everyone = tuple(range(len(facts)))
    errors = [f for f in facts if f.probe_error]
    if errors:
        return PreflightCheck(
            "save_dir shared", False, f"{_where(facts, [f.rank for f in errors])}: {errors[0].probe_error}"
        )
    apart = [f.rank for f in facts if f.rank not in facts[0].sees or 0 not in f.sees]
    if not apart and all(f.sees == everyone for f in facts):
        return PreflightCheck("save_dir shared", True, f"{probe_dir}: every rank sees every rank's files")
    if not apart:  # rank 0 and the others agree, yet some pair does not: name who misses files
        apart = [f.rank for f in facts if f.sees != everyone]
    return PreflightCheck(
        "save_dir shared",
        False,
        f"{_where(facts, apart)} and rank 0 do not see each other's files in {probe_dir}: every rank "
        "saves its shards there, so it must be one file system shared by every node "
        "(set trainer.checkpointing.save_dir to a shared path)",
    )


def _room_check(loaded: LoadedJob, free: int, estimate: int) -> PreflightCheck:
    ccfg = loaded.config.trainer.checkpointing
    run_dir = loaded.paths.run_dir
    found = list_checkpoints(run_dir)
    copies = ccfg.num_to_keep + 1 + (ccfg.keep_best.count if ccfg.keep_best is not None else 0)
    if found:
        size = _bytes_under(found[-1].path)
        source = f"the size of {found[-1].path.name}"
        held = sum(_bytes_under(info.path) for info in found[-copies:])
    else:
        size, source, held = estimate, "the plan's estimate", 0
    need = max(0, copies * size - held)
    detail = f"{format_size(free)} free, {copies} checkpoints of {format_size(size)} ({source}) need {format_size(need)} more"
    if free >= need:
        return PreflightCheck("save_dir room", True, detail)
    return PreflightCheck(
        "save_dir room",
        False,
        f"{detail}: free space on that file system or lower trainer.checkpointing.num_to_keep",
    )


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _bandwidth_checks(facts: Sequence[_RankFacts], threshold: float) -> list[PreflightCheck]:
    timings = [t for f in facts for t in f.timings]
    if not timings:
        return [PreflightCheck("collectives", True, "one process: nothing to measure")]
    slow, bandwidth = slow_groups(timings, threshold=threshold)
    checks = []
    for axis in dict.fromkeys(axis for axis, _, _ in bandwidth):
        parts = []
        for op in dict.fromkeys(op for a, op, _ in bandwidth if a == axis):
            values = [bw for (a, o, _), bw in bandwidth.items() if (a, o) == (axis, op)]
            shown = f"{_rate(statistics.median(values))}"
            if len(values) > 1:
                shown = f"median {shown}, min {_rate(min(values))}"
            parts.append(f"{op} {shown}")
        bad = [s for s in slow if s.axis == axis]
        groups = len({g for a, _, g in bandwidth if a == axis})
        detail = f"{groups} group{'s' if groups > 1 else ''}: " + "; ".join(parts)
        if bad:
            named = "; ".join(
                f"group {', '.join(map(str, s.group))} {_rate(s.bandwidth)} in {s.op} vs median {_rate(s.median)}"
                for s in bad
            )
            detail = f"slow {named} ({detail})"
        checks.append(PreflightCheck(f"bandwidth {axis}", not bad, detail))
    if slow:
        suspects = suspect_ranks(slow)
        if suspects:
            checks.append(
                PreflightCheck(
                    "slow ranks",
                    False,
                    f"{_where(facts, suspects)}: in every slow group of "
                    f"{', '.join(dict.fromkeys(s.axis for s in slow))}; check its links and load",
                )
            )
    return checks


def slow_ranks(values: Mapping[int, float], threshold: float) -> list[int]:
    """The ranks whose value (higher is better) is below `(1 - threshold)` × the median of all."""
    if len(values) < 2:
        return []
    median = statistics.median(values.values())
    return sorted(r for r, v in values.items() if v < (1 - threshold) * median)


def _cuda_checks(facts: Sequence[_RankFacts], need: int, threshold: float) -> list[PreflightCheck]:
    checks = []
    short = [f.rank for f in facts if f.device_free is not None and f.device_free < need]
    least = min(facts, key=lambda f: f.device_free or 0)
    detail = f"least free {format_size(least.device_free or 0)} of {format_size(least.device_total or 0)} on rank {least.rank}; the plan needs {format_size(need)}"
    if short:
        detail = f"{_where(facts, short)} short: {detail}; free the devices or see `d9d plan` for levers"
    checks.append(PreflightCheck("device memory", not short, detail))
    ecc = {f.rank: f.ecc_uncorrected for f in facts if f.ecc_uncorrected is not None}
    if ecc:
        bad = [r for r, n in ecc.items() if n > 0]
        text = (
            f"{_where(facts, bad)}: uncorrected ECC errors ({', '.join(str(ecc[r]) for r in bad)}); "
            "replace or reset those GPUs"
            if bad
            else "none"
        )
        checks.append(PreflightCheck("ECC errors", not bad, text))
    else:
        checks.append(PreflightCheck("ECC errors", True, "not reported (install pynvml to read NVML)"))
    clocks = {f.rank: float(f.sm_clock_mhz) for f in facts if f.sm_clock_mhz is not None}
    if clocks:
        checks.append(
            _median_check(
                "clocks",
                facts,
                clocks,
                threshold,
                f"SM clock median {statistics.median(clocks.values()):.0f} MHz",
            )
        )
    flops = {f.rank: f.matmul_flops for f in facts if f.matmul_flops is not None}
    if flops:
        median, least = statistics.median(flops.values()) / 1e12, min(flops.values()) / 1e12
        checks.append(
            _median_check(
                "compute",
                facts,
                flops,
                threshold,
                f"bf16 matmul median {median:.0f} TFLOP/s, min {least:.0f}",
            )
        )
    return checks


def _median_check(
    name: str, facts: Sequence[_RankFacts], values: Mapping[int, float], threshold: float, summary: str
) -> PreflightCheck:
    low = slow_ranks(values, threshold)
    if not low:
        return PreflightCheck(name, True, summary)
    return PreflightCheck(name, False, f"{_where(facts, low)} below the median: {summary}")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def format_preflight(report: PreflightReport) -> list[str]:
    """The preflight table's lines: a heading, then one line per check (status, name, detail)."""
    nodes = len(set(report.nodes))
    lines = [
        f"preflight: {report.world_size} rank{'s' if report.world_size != 1 else ''} on {nodes} "
        f"node{'s' if nodes != 1 else ''}, mesh {report.mesh}, {report.device}"
    ]
    width = max(len(check.name) for check in report.checks)
    for check in report.checks:
        lines.append(f"  {'ok  ' if check.ok else 'FAIL'}  {check.name.ljust(width)}  {check.detail}")
    failed = sum(not check.ok for check in report.checks)
    lines.append("all checks passed" if not failed else f"{failed} check{'s' if failed > 1 else ''} failed")
    return lines
