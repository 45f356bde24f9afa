"""Collective bandwidth per mesh axis: the axes measured (each group set once), and which groups and
ranks `slow_groups` and `suspect_ranks` name, measured on forked gloo ranks with one rank slowed."""

import time

from d9d.mesh import (
    CollectiveTiming,
    DistributedContext,
    MeshConfig,
    measure_axes,
    slow_groups,
    suspect_ranks,
)
from d9d.mesh.testing import run_distributed


def _measure(slow_rank: int | None) -> list[CollectiveTiming]:
    ctx = DistributedContext.from_env(MeshConfig(data_parallel_replicate=2, data_parallel_shard=2))
    pause = (lambda: time.sleep(0.03)) if ctx.rank == slow_rank else None
    return measure_axes(ctx, nbytes=2**18, iters=5, before_call=pause)


def test_each_axis_is_measured_once_and_the_slowed_rank_is_the_one_suspect():
    per_rank = run_distributed(_measure, 4, 1, env={"OMP_NUM_THREADS": "1"})
    timings = [t for rank in per_rank for t in rank]
    # dp_replicate groups (0, 2), (1, 3); dp_shard (0, 1), (2, 3); `dp` spans the world: measured as dp
    seen = {(t.axis, t.group) for t in timings}
    assert seen == {("dp_replicate", (0, 2)), ("dp_replicate", (1, 3)), ("dp_shard", (0, 1)),
                    ("dp_shard", (2, 3)), ("dp", (0, 1, 2, 3))}  # fmt: skip
    assert {t.op for t in timings} == {"all_reduce", "all_gather", "all_to_all"}
    assert all(t.nbytes == 2**18 and t.seconds > 0 for t in timings)
    slow, bandwidth = slow_groups(timings)
    assert {(s.axis, s.group) for s in slow} == {("dp_replicate", (1, 3)), ("dp_shard", (0, 1))}
    assert all(s.bandwidth < 0.75 * s.median for s in slow)
    assert len(bandwidth) == 5 * 3
    assert suspect_ranks(slow) == [1]


def _timing(axis: str, group: tuple[int, ...], seconds: float, op: str = "all_reduce") -> CollectiveTiming:
    return CollectiveTiming(axis, op, group, group[0], 2**20, seconds)


def test_one_noisy_collective_does_not_flag_a_group_and_a_lone_group_has_nothing_to_compare():
    fast, slow = 1e-3, 1e-2
    timings = [
        _timing("tp", (0, 1), fast), _timing("tp", (2, 3), fast),
        _timing("tp", (0, 1), fast, "all_gather"), _timing("tp", (2, 3), slow, "all_gather"),  # one op
        _timing("tp", (0, 1), fast, "all_to_all"), _timing("tp", (2, 3), fast, "all_to_all"),
        _timing("world", (0, 1, 2, 3), slow),
    ]  # fmt: skip
    assert slow_groups(timings)[0] == []
    assert suspect_ranks([]) == []
