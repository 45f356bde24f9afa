"""Collective bandwidth over each axis of a job's mesh, and which groups (and ranks) fall behind.

`measure_axes(ctx)` runs all-reduce, all-gather and all-to-all over every process group of every mesh
axis of more than one rank (all groups of an axis at once, as a training step uses them) and returns
this rank's `CollectiveTiming`s. Gather every rank's list (e.g. `torch.distributed.all_gather_object`)
and `slow_groups` compares each group with the other groups of its axis: a group whose bus bandwidth
is below the median of its axis by more than a threshold is slow, and the ranks that every slow
group of an axis holds are the suspects (`suspect_ranks`).

Bus bandwidth follows the convention of NCCL's own tests, so figures compare across group sizes: the
bytes each rank moves over its link per second, algorithm bandwidth (buffer bytes / time) times
2(n-1)/n for all-reduce and (n-1)/n for all-gather and all-to-all.
"""

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from d9d.mesh.context import DistributedContext
from d9d.mesh.layout import DOMAINS, axis_groups

__all__ = ["COLLECTIVES", "CollectiveTiming", "SlowGroup", "measure_axes", "slow_groups", "suspect_ranks"]

#: The collectives measured, in order.
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")

_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective over one group, as one rank timed it.

    Attributes:
        axis: the mesh axis (e.g. "dp_shard", "tp"; "world" for every rank at once).
        op: one of `COLLECTIVES`.
        group: the global ranks of the group, in axis order.
        rank: the global rank that timed it.
        nbytes: the bytes of the buffer: each rank's input for all-reduce and all-to-all, the gathered
            output for all-gather.
        seconds: the median time of one call over the timed calls (after a warm-up call): a rank
            that the OS schedules away once does not count as slow.
    """

    axis: str
    op: str
    group: tuple[int, ...]
    rank: int
    nbytes: int
    seconds: float

    @property
    def bus_bandwidth(self) -> float:
        """Bytes per second over each rank's link (NCCL tests' "busbw")."""
        return self.nbytes / self.seconds * _BUS_FACTOR[self.op](len(self.group))


@dataclass(frozen=True)
class SlowGroup:
    """A group whose bus bandwidth on `axis` for `op` is below its axis's median by more than the
    threshold: `bandwidth` (the group's, bytes/s) vs `median` (over the axis's groups)."""

    axis: str
    op: str
    group: tuple[int, ...]
    bandwidth: float
    median: float


def _axes(ctx: DistributedContext) -> list[tuple[str, str]]:
    """(domain, axis) of every mesh axis with more than one rank whose groups no earlier axis has
    (e.g. `dp` is `dp_shard` without replication), then the world when no axis spans it. The expert
    domain's axes count only under expert parallelism (without it they relabel the dense ranks)."""
    config = ctx.config
    domains = ("dense", "expert", "batch") if config.expert_parallel > 1 else ("dense", "batch")
    seen: list[set[tuple[int, ...]]] = []
    axes = []
    for domain in domains:
        for axis in DOMAINS[domain]:
            if ctx.axis_size(axis) <= 1:
                continue
            groups = {tuple(g) for g in axis_groups(config, domain, axis)}
            if groups in seen:
                continue
            seen.append(groups)
            axes.append((domain, axis))
    if not any(len(groups) == 1 for groups in seen):
        axes.append(("world", "world"))
    return axes


def measure_axes(
    ctx: DistributedContext,
    *,
    nbytes: int = 16 * 2**20,
    iters: int = 5,
    ops: Sequence[str] = COLLECTIVES,
    before_call: Callable[[], None] | None = None,
) -> list[CollectiveTiming]:
    """Time `ops` over this rank's group of every mesh axis of more than one rank (see module doc).

    Every rank must call this with the same arguments (the groups run the same collectives in the same
    order). `nbytes` is rounded down to whole float32 elements divisible by every group size.
    `before_call` runs before each timed call on this rank (e.g. to model a slow rank in a test).
    In local mode (one process) there is nothing to measure: an empty list.
    """
    if ctx.is_local or ctx.world_size == 1:
        return []
    unknown = [op for op in ops if op not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; choose from {list(COLLECTIVES)}")
    timings = []
    for domain, axis in _axes(ctx):
        if domain == "world":
            group = dist.group.WORLD
            ranks = tuple(range(ctx.world_size))
        else:
            mesh = ctx.mesh(domain)
            group = mesh.get_group(axis)
            ranks = tuple(dist.get_process_group_ranks(group))
        for op in ops:
            seconds, size = _time(op, group, len(ranks), nbytes, iters, ctx.device, before_call)
            timings.append(CollectiveTiming(axis, op, ranks, ctx.rank, size, seconds))
    return timings


def _time(
    op: str,
    group: dist.ProcessGroup,
    n: int,
    nbytes: int,
    iters: int,
    device: torch.device,
    before_call: Callable[[], None] | None,
) -> tuple[float, int]:
    elements = max(n, nbytes // 4 // n * n)
    if op == "all_gather":
        out = torch.empty(elements, device=device)
        buf = torch.ones(elements // n, device=device)

        def call() -> None:
            dist.all_gather_into_tensor(out, buf, group=group)
    elif op == "all_to_all":
        out = torch.empty(elements, device=device)
        buf = torch.ones(elements, device=device)

        def call() -> None:
            dist.all_to_all_single(out, buf, group=group)
    else:
        buf = torch.ones(elements, device=device)

        def call() -> None:
            dist.all_reduce(buf, group=group)

    call()  # warm-up: connections, buffers
    _sync(group, device)
    times = []
    for _ in range(max(1, iters)):
        if before_call is not None:
            before_call()
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    _sync(group, device)
    return statistics.median(times), elements * 4


def _sync(group: dist.ProcessGroup, device: torch.device) -> None:
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_bandwidth(timings: Sequence[CollectiveTiming]) -> float:
    """A group's bandwidth: its slowest member's view (a collective ends when its last rank is done)."""
    return min(t.bus_bandwidth for t in timings)


def slow_groups(
    timings: Sequence[CollectiveTiming], *, threshold: float = 0.25
) -> tuple[list[SlowGroup], dict[tuple[str, str, tuple[int, ...]], float]]:
    """The slow groups among every rank's `timings`, and each group's bus bandwidth by (axis, op, group).

    Each group's bandwidth for each collective is divided by the median of its axis's groups for that
    collective; a group is slow when the median of those ratios over the collectives is below
    `1 - threshold` (one noisy collective does not flag a group; a slow link or rank slows them all).
    Its `SlowGroup` carries the collective whose ratio is that median. An axis of one group has nothing
    to compare with.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold {threshold} is not between 0 and 1 (e.g. 0.25: 25% below the median)")
    by_group: dict[tuple[str, str, tuple[int, ...]], list[CollectiveTiming]] = {}
    for timing in timings:
        by_group.setdefault((timing.axis, timing.op, timing.group), []).append(timing)
    bandwidth = {key: _group_bandwidth(group) for key, group in by_group.items()}
    medians = {
        (axis, op): statistics.median(bw for (a, o, _), bw in bandwidth.items() if (a, o) == (axis, op))
        for axis, op, _ in bandwidth
    }
    groups_of: dict[str, set[tuple[int, ...]]] = {}
    for axis, _, group in bandwidth:
        groups_of.setdefault(axis, set()).add(group)
    slow = []
    for axis, groups in groups_of.items():
        if len(groups) < 2:
            continue
        for group in sorted(groups):
            ratios = sorted(
                (bw / medians[(a, op)], op)
                for (a, op, g), bw in bandwidth.items()
                if a == axis and g == group
            )
            ratio, op = ratios[(len(ratios) - 1) // 2]
            if ratio < 1 - threshold:
                slow.append(SlowGroup(axis, op, group, bandwidth[(axis, op, group)], medians[(axis, op)]))
    return slow, bandwidth


def suspect_ranks(slow: Sequence[SlowGroup]) -> list[int]:
    """The ranks every slow group of some axis holds, on every axis with a slow group: one slow rank
    slows one group on each of its axes, and only it is in all of them. Empty when they share none."""
    per_axis: dict[str, set[int]] = {}
    for item in slow:
        members = set(item.group)
        per_axis[item.axis] = per_axis[item.axis] & members if item.axis in per_axis else members
    if not per_axis:
        return []
    common = set.intersection(*per_axis.values())
    return sorted(common)
