"""`plan_fit`: whether a planned job fits in a device's memory, and which config changes would make it.

Every figure is a plan's own (`MemoryPlan.total`): a lever is the job re-planned with its
overrides (`LoadedJob.with_overrides` + `plan_config`), never a second estimate, so applying a lever's
`--set` arguments and planning again prints exactly the total predicted here. A change the trainer
would refuse (a batch that no longer splits, a mesh the model provider rejects) is no lever.

The levers, each only where it applies:

- setting levers (`_SETTING_LEVERS`), one function each of the job and its plan that returns the
  overrides and the reason, or None where the lever does not apply: full activation checkpointing,
  microbatches of one sample, sharding instead of replicating over the data-parallel ranks, optimizer
  states in bfloat16, CPU offload. A new lever is one more such function in that tuple; the search and the
  combinations take it up unchanged.
- more ranks: the smallest `data_parallel_shard` × 2^k that fits (more processes, the same global
  batch, which must still split).

When no single lever fits, combinations are tried, fewest levers first, each with the smallest
data_parallel_shard doubling that makes it fit, and the smallest combinations that fit are listed.
"""

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from d9d.mesh import D9dError
from d9d.trainer.builtins.data import AutoDataProviderFactory
from d9d.trainer.job.load import LoadedJob
from d9d.trainer.job.resolve import ResolvedJob, resolve_job

if TYPE_CHECKING:
    from d9d.trainer.planning.plan import JobPlan

__all__ = ["FIT_HEADROOM", "FitPlan", "Lever", "plan_fit"]

#: The share of a device's memory a job may plan for: the estimate leaves out temporary buffers,
#: allocator fragmentation, the CUDA context and communication buffers, which take the rest.
FIT_HEADROOM = 0.9
#: At most this many doublings of data_parallel_shard are tried (1024× the ranks).
MAX_SHARD_DOUBLINGS = 10


@dataclass(frozen=True)
class Lever:
    """One change of the config (one lever, or a combination) and the plan's total with it.

    Attributes:
        overrides: the `key.path=value` overrides that make the change, in order (pass each as
            `--set key.path=value`; `arguments` writes them so).
        reason: what the change does, in one line.
        total: the bytes the most loaded rank needs with the change (`MemoryPlan.total` of the
            re-planned job).
        fits: whether `total` is within the budget (`FitPlan.budget`).
        world_size: the processes the changed job runs on.
    """

    overrides: tuple[str, ...]
    reason: str
    total: int
    fits: bool
    world_size: int

    @property
    def arguments(self) -> str:
        """The overrides as command-line arguments: `--set key.path=value ...`."""
        return " ".join(f"--set {item}" for item in self.overrides)


@dataclass(frozen=True)
class FitPlan:
    """Whether a job fits in a device's memory and, when it does not, the levers that were tried.

    Attributes:
        device_bytes: the device's memory.
        budget: what the job may use of it: `device_bytes` × `FIT_HEADROOM`, rounded down.
        total: the bytes the job's most loaded rank needs (`MemoryPlan.total`).
        levers: when it does not fit, each lever (or combination) that applies, with its total, in
            the order tried; () when it fits.
        activations_note: why the totals hold no activations ("" when they do: see
            `MemoryPlan.activations_note`).
    """

    device_bytes: int
    budget: int
    total: int
    levers: tuple[Lever, ...]
    activations_note: str = ""

    @property
    def fits(self) -> bool:
        """Whether the job fits as configured."""
        return self.total <= self.budget

    @property
    def margin(self) -> int:
        """Bytes left in the budget (negative: how much the job is over it)."""
        return self.budget - self.total


def plan_fit(plan: "JobPlan", config: LoadedJob, device_bytes: int) -> FitPlan:
    """Whether `plan` (of `config`, with its memory) fits in `device_bytes` per rank, and which levers
    would make it fit: each re-planned with `plan_config` as `d9d plan` plans (rank 0, the plan's
    device and sequence length).

    Raises:
        ValueError: the plan has no memory estimate (`plan_job(..., memory=True)`) or `device_bytes`
            is not positive.
    """
    if plan.memory is None:
        raise ValueError("plan_fit needs a plan with its memory estimate: plan_job(..., memory=True)")
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be positive, got {device_bytes}")
    budget = int(device_bytes * FIT_HEADROOM)
    fit = FitPlan(device_bytes, budget, plan.memory.total, (), plan.memory.activations_note)
    if fit.fits:
        return fit
    return FitPlan(
        device_bytes, budget, fit.total, _Search(plan, config, budget).levers(), fit.activations_note
    )


# ---------------------------------------------------------------------------------------- levers


@dataclass(frozen=True)
class _Change:
    """A setting lever as it applies to one job: its overrides, a short name for combinations, why."""

    overrides: tuple[str, ...]
    name: str
    reason: str


#: A setting lever: the change it makes to a job (its resolved config and plan), None where it does not apply.
_SettingLever = Callable[[ResolvedJob, "JobPlan"], _Change | None]


def _full_checkpointing(job: ResolvedJob, plan: "JobPlan") -> _Change | None:
    if job.config.trainer.activation_checkpointing.mode == "full":
        return None
    if plan.memory is None or plan.memory.activations is None:
        return None  # nothing to predict the saving from
    return _Change(
        ("trainer.activation_checkpointing.mode=full",),
        "full activation checkpointing",
        "full activation checkpointing: every block keeps only its input and recomputes its forward "
        "in backward (one more forward per step)",
    )


def _microbatch_of_one(job: ResolvedJob, plan: "JobPlan") -> _Change | None:
    batching = plan.batching
    if not isinstance(job.data_factory, AutoDataProviderFactory) or batching is None:
        return None  # the key is AutoDataProvider's; another factory batches as it decides
    if plan.pipeline is not None or batching.microbatch_size == 1:
        return None  # under pp the microbatch count also sets the schedule: not a memory-only change
    if plan.memory is None or plan.memory.activations is None:
        return None
    size, n = batching.microbatch_size, batching.microbatches_per_step
    return _Change(
        ("data.microbatch_size=1",),
        "microbatches of 1",
        f"microbatches of 1 sample instead of {size}: the same global batch of "
        f"{batching.global_batch_size}, {n * size} microbatches per rank and step instead of {n}",
    )


def _replicate_to_shard(job: ResolvedJob, plan: "JobPlan") -> _Change | None:
    mesh = plan.mesh
    replicate, shard = mesh.data_parallel_replicate, mesh.data_parallel_shard
    if replicate == 1 or plan.memory is None:
        return None
    factor = plan.memory.state.shard_factor
    return _Change(
        ("mesh.data_parallel_replicate=1", f"mesh.data_parallel_shard={replicate * shard}"),
        "shard instead of replicate",
        f"shard over all {replicate * shard} data-parallel ranks instead of replicating over "
        f"{replicate}: the same {mesh.world_size} processes and batches, each rank keeping 1/"
        f"{factor * replicate} of the parameters, gradients and optimizer state instead of 1/{factor}",
    )


def _bf16_states(job: ResolvedJob, plan: "JobPlan") -> _Change | None:
    if job.config.optimizer.state_dtype == "bfloat16" or plan.memory is None:
        return None
    if plan.memory.state.optimizer == 0:
        return None  # no optimizer state to halve (SGD without momentum)
    return _Change(
        ("optimizer.state_dtype=bfloat16",),
        "bf16 optimizer states",
        "optimizer states in bfloat16: half the optimizer state's bytes (updates computed in float32; "
        "the loss drifts slightly, see docs/performance.md)",
    )


def _cpu_offload(job: ResolvedJob, plan: "JobPlan") -> _Change | None:
    mesh = job.config.mesh
    if job.config.trainer.memory.cpu_offload or plan.memory is None:
        return None
    if mesh.data_parallel_shard * mesh.context_parallel == 1 or mesh.expert_parallel > 1:
        return None  # offload needs FSDP shards and does not take expert banks (the trainer refuses)
    return _Change(
        ("trainer.memory.cpu_offload=true",),
        "CPU offload",
        "CPU offload: parameters, gradients and optimizer state of every FSDP unit in pinned host memory "
        "(host-device copies every unit and step, the optimizer steps on the CPU)",
    )


#: The setting levers, in the order they are tried and listed (see the module's docstring to add one).
_SETTING_LEVERS: tuple[_SettingLever, ...] = (
    _full_checkpointing,
    _microbatch_of_one,
    _replicate_to_shard,
    _bf16_states,
    _cpu_offload,
)


# ---------------------------------------------------------------------------------------- search


class _Search:
    """Re-plans `config` with each candidate change (each set of overrides planned once)."""

    def __init__(self, plan: "JobPlan", config: LoadedJob, budget: int) -> None:
        self._plan = plan
        self._config = config
        self._budget = budget
        self._plans: dict[tuple[str, ...], JobPlan | None] = {}

    def levers(self) -> tuple[Lever, ...]:
        job = resolve_job(self._config)
        changes = [c for c in (lever(job, self._plan) for lever in _SETTING_LEVERS) if c is not None]
        singles = [self._lever(c.overrides, c.reason) for c in changes]
        scaled = self._scaled((), "")
        found = [lever for lever in [*singles, scaled] if lever is not None]
        if any(lever.fits for lever in found):
            return tuple(found)
        return tuple(found) + self._combinations(changes)

    def _combinations(self, changes: list[_Change]) -> tuple[Lever, ...]:
        """The smallest combinations that fit (fewest levers first, none containing a smaller one that
        fits), each setting combination also with the data_parallel_shard doubling that makes it fit;
        when none fits, everything at once."""
        fitting: list[tuple[frozenset[str], Lever]] = []
        last: Lever | None = None
        for size in range(1, len(changes) + 1):
            for combo in itertools.combinations(changes, size):
                names = frozenset(c.name for c in combo)
                overrides = _merged(c.overrides for c in combo)
                reason = " + ".join(c.name for c in combo)
                tries = [(names, False)] if size > 1 else []  # one setting alone was tried already
                for key, scaled in [*tries, (names | {"more ranks"}, True)]:
                    if any(smaller <= key for smaller, _ in fitting):
                        continue
                    lever = self._scaled(overrides, reason) if scaled else self._lever(overrides, reason)
                    if lever is not None:
                        last = lever
                        if lever.fits:
                            fitting.append((key, lever))
        if fitting:
            return tuple(lever for _, lever in fitting)
        return (last,) if last is not None else ()

    def _scaled(self, base: tuple[str, ...], reason: str) -> Lever | None:
        """`base` with the smallest data_parallel_shard × 2^k (k ≥ 1) that fits; when none does, the
        largest the trainer accepts; None when it accepts no doubling."""
        start = self._replan(base)
        if start is None:
            return None
        mesh = start.mesh
        best: Lever | None = None
        for k in range(1, MAX_SHARD_DOUBLINGS + 1):
            shard = mesh.data_parallel_shard * 2**k
            overrides = _merged([base, (f"mesh.data_parallel_shard={shard}",)])
            world = mesh.world_size * 2**k
            batch = start.batching
            kept = (
                f"; the global batch of {batch.global_batch_size} still splits" if batch is not None else ""
            )
            more = (
                f"data_parallel_shard {shard} instead of {mesh.data_parallel_shard}: {world} processes "
                f"instead of {mesh.world_size}, each keeping 1/{2**k} of the state it kept{kept}"
            )
            lever = self._lever(overrides, f"{reason} + {more}" if reason else more)
            if lever is None:
                break  # refused (e.g. the batch no longer splits): more ranks are refused too
            best = lever
            if lever.fits:
                break
        return best

    def _lever(self, overrides: tuple[str, ...], reason: str) -> Lever | None:
        plan = self._replan(overrides)
        if plan is None or plan.memory is None:
            return None
        total = plan.memory.total
        return Lever(overrides, reason, total, total <= self._budget, plan.mesh.world_size)

    def _replan(self, overrides: tuple[str, ...]) -> "JobPlan | None":
        """The job re-planned with `overrides` (the plan itself for none), None where the trainer refuses it."""
        from d9d.trainer.planning.job_plan import plan_config

        if not overrides:
            return self._plan
        if overrides not in self._plans:
            try:
                changed = self._config.with_overrides(overrides)
                plan = plan_config(changed, seq_len=self._plan.sequence.seq_len, device=self._plan.device)
            except D9dError:
                plan = None
            self._plans[overrides] = plan
        return self._plans[overrides]


def _merged(groups: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Overrides of several changes as one list: a key set twice keeps its last value, at its first place."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key, _, value = item.partition("=")
            merged[key] = value
    return tuple(f"{key}={value}" for key, value in merged.items())
