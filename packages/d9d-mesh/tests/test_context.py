import datetime
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from d9d.mesh import DOMAINS, D9dError, DistributedContext, LaunchError, MeshConfig, axis_groups
from d9d.mesh.testing import DistributedTestError, run_distributed


def test_local_mode_has_no_process_group():
    with DistributedContext.from_env(MeshConfig(), environ={}, device="cpu") as ctx:
        assert ctx.is_local and ctx.mode == "local"
        assert not dist.is_initialized()
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
        assert ctx.is_main_process and ctx.is_local_main_process
        assert ctx.device == torch.device("cpu")
        assert ctx.coordinate("dp_shard") == 0 and ctx.axis_size("tp") == 1
        assert ctx.log_tag == "local"
        ctx.barrier()  # a no-op, not an error
        ctx.use_step_timeout()
        with pytest.raises(D9dError, match="no device mesh in local mode"):
            ctx.mesh()


@pytest.mark.parametrize(
    ("config", "environ", "message"),
    [
        (
            MeshConfig(data_parallel_shard=2, tensor_parallel=2),
            {},
            r"the mesh \(data_parallel_shard=2, tensor_parallel=2\) needs 4 processes, but plain python "
            r"\(no torchrun\) started 1; launch with `torchrun --nproc-per-node 4",
        ),
        (
            MeshConfig(data_parallel_shard=4),
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
            r"needs 4 processes, but torchrun started 2; launch with `torchrun --nproc-per-node 4 ...` on one node "
            r"or `torchrun --nnodes 2 --nproc-per-node 2 ...`",
        ),
        (
            MeshConfig(),
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
            r"the mesh \(all degrees 1\) needs 1 process, but torchrun started 2; run it as one plain process",
        ),
        (
            MeshConfig(),
            {"RANK": "0"},
            r"sets \['RANK'\] but not \['WORLD_SIZE', 'LOCAL_RANK'\]",
        ),
    ],
)
def test_launch_mismatch_is_one_clear_error(config, environ, message):
    with pytest.raises(LaunchError, match=message):
        DistributedContext.from_env(config, environ=environ, device="cpu")
    assert not dist.is_initialized()


def _describe_rank(config):
    with DistributedContext.from_env(config) as ctx:
        groups = {}
        for domain, mesh in ((d, ctx.mesh(d)) for d in ("dense", "expert", "batch", "world")):
            for axis in mesh.mesh_dim_names:
                members = [None] * mesh.size(mesh.mesh_dim_names.index(axis))
                dist.all_gather_object(members, ctx.rank, group=mesh.get_group(axis))
                groups[(domain, axis)] = members
        torch_coords = {d: ctx.mesh(d).get_coordinate() for d in ("dense", "expert", "batch")}
        return ctx.rank, ctx.coordinates, torch_coords, groups, ctx.log_tag


@pytest.mark.parametrize(
    "config",
    [
        MeshConfig(data_parallel_shard=2),
        MeshConfig(data_parallel_replicate=2, expert_parallel=2),
        MeshConfig(data_parallel_shard=2, tensor_parallel=2),
        MeshConfig(pipeline_parallel=2, data_parallel_replicate=2, expert_parallel=2),
        MeshConfig(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=4),
    ],
    ids=lambda c: f"{c.world_size}ranks-{c.describe_degrees()}",
)
def test_real_meshes_match_layout(config):
    results = run_distributed(_describe_rank, config.world_size, config)
    for rank, (reported, coords, torch_coords, groups, tag) in enumerate(results):
        assert reported == rank
        for domain, tc in torch_coords.items():
            assert list(tc) == list(coords[domain].values())
        # the process group of each axis holds exactly the ranks the pure layout says
        for (domain, axis), members in groups.items():
            expected = next(g for g in axis_groups(config, domain, axis) if rank in g)
            assert members == expected, (domain, axis)
        assert tag.startswith(f"rank {rank}")


def _timeout_rank(config, axis):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = DistributedContext.from_env(config, step_timeout=datetime.timedelta(seconds=1))
        ctx.use_step_timeout()
    with ctx:
        group = None if axis is None else ctx.mesh("dense").get_group(axis)
        if ctx.rank == 1:
            time.sleep(3)
            return "slept", []
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
        except Exception as exc:
            outcome = ("failed", time.monotonic() - start, type(exc).__name__)
        else:
            outcome = ("finished", time.monotonic() - start, "")
        if ctx.rank != 0:
            return "other", []
        return outcome, [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.parametrize(
    ("config", "axis"),
    [(MeshConfig(data_parallel_shard=2), None), (MeshConfig(data_parallel_shard=2, tensor_parallel=2), "tp")],
    ids=["2ranks-default-group", "4ranks-tp-subgroup"],
)
def test_step_timeout_fails_a_stuck_collective_quickly_without_warnings(config, axis):
    results = run_distributed(_timeout_rank, config.world_size, config, axis, timeout=30)
    assert results[1] == ("slept", [])
    (status, elapsed, _), caught = results[0]
    assert status == "failed"
    assert elapsed < 4, f"collective waited {elapsed:.1f} s with a 1 s step timeout"
    assert caught == []  # the deprecated _set_pg_timeout warned twice per rank


def _group_timeouts(config):
    def timeouts(groups):
        return {g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups}

    init, step = datetime.timedelta(seconds=70), datetime.timedelta(seconds=7)
    with DistributedContext.from_env(config, init_timeout=init, step_timeout=step) as ctx:
        groups = [g for domain in DOMAINS for g in ctx.mesh(domain).get_all_groups()]
        before = timeouts(groups)
        # as d9d.parallel does while the job is built: a flattened mesh, with torch's default timeout
        groups.append(ctx.mesh("dense")["dp_replicate", "dp_shard"]._flatten("dp_flat").get_group())
        ctx.use_step_timeout()
        after = timeouts(groups)
        default = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        return before, after, default


def test_step_timeout_reaches_every_group_of_the_meshes():
    config = MeshConfig(pipeline_parallel=2, data_parallel_shard=2)
    for before, after, default in run_distributed(_group_timeouts, 4, config):
        assert before <= {70.0, 60.0}  # subgroups start with init_s (the harness's own group: 60 s)
        assert after == {7.0} and default == 7.0  # flattened groups made after start-up too


def test_planning_mode_builds_1024_rank_mesh_in_one_process():
    config = MeshConfig(
        pipeline_parallel=4,
        data_parallel_replicate=2,
        data_parallel_shard=16,
        tensor_parallel=8,
        expert_parallel=32,
    )
    with DistributedContext.for_planning(config, rank=777) as ctx:
        assert ctx.mode == "planning" and dist.get_world_size() == 1024
        assert ctx.mesh("dense").shape == (4, 2, 16, 1, 8)
        assert ctx.mesh("expert").shape == (4, 8, 32)
        assert ctx.mesh("batch").shape == (4, 32, 1, 8)
        assert list(ctx.mesh("dense").get_coordinate()) == list(ctx.coordinates["dense"].values())
        assert ctx.coordinate("pp") == 777 // 256
        assert "world size 1024" in ctx.describe()
    assert not dist.is_initialized()


def _fsdp_shard_coordinates() -> tuple[int, int]:
    from torch.distributed.fsdp import fully_shard

    ctx = DistributedContext.from_env(MeshConfig(pipeline_parallel=2, data_parallel_shard=2))
    mesh = ctx.mesh("dense")["dp_shard"]
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    fully_shard(module, mesh=mesh)
    return mesh.get_local_rank(), module[1].weight.device_mesh.get_local_rank()


def test_a_closed_plan_leaves_no_cached_coordinates_to_forked_ranks():
    # FSDP2 on the planning mesh caches DTensor specs; the real meshes of ranks forked later compare
    # equal to it, and without the cache cleared every rank's shards claimed rank 0's offset.
    config = MeshConfig(pipeline_parallel=2, data_parallel_shard=2)
    with DistributedContext.for_planning(config) as ctx:
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
        fully_shard(module, mesh=ctx.mesh("dense")["dp_shard"])
    for mesh_rank, shard_rank in run_distributed(_fsdp_shard_coordinates, 4):
        assert shard_rank == mesh_rank


def test_planning_mode_checks_world_size():
    with pytest.raises(LaunchError, match="needs 4 processes, but the plan started 8"):
        DistributedContext.for_planning(MeshConfig(data_parallel_shard=4), world_size=8)


def _single_process_beside_the_group() -> tuple[str, int, int, bool]:
    one = DistributedContext.single_process()
    return one.mode, one.world_size, one.rank, dist.is_initialized()


def test_a_single_process_context_is_local_mode_beside_any_process_group():
    with DistributedContext.for_planning(MeshConfig(data_parallel_shard=4), rank=3):
        one = DistributedContext.single_process()
        assert (one.is_local, one.world_size, one.rank, one.device.type) == (True, 1, 0, "cpu")
        assert one.coordinates["dense"] == dict.fromkeys(("pp", "dp_replicate", "dp_shard", "cp", "tp"), 0)
    for result in run_distributed(_single_process_beside_the_group, 2):  # a real rank of 2, untouched
        assert result == ("local", 1, 0, True)


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for a rank that never comes; the harness must not hang
    return "unreachable"


def test_harness_reports_failing_rank_traceback_and_kills_the_rest():
    start = time.monotonic()
    with pytest.raises(
        DistributedTestError, match=r"rank 1 of 2 failed: ValueError: boom on purpose"
    ) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=30)
    assert "_raise_on_rank_one" in str(info.value)  # the traceback is included
    assert time.monotonic() - start < 15


def _hang_forever():
    if dist.get_rank() == 0:
        time.sleep(600)


def test_harness_times_out_a_hang():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] of 2 did not finish within 2 s"):
        run_distributed(_hang_forever, 2, timeout=2)
    assert time.monotonic() - start < 10


def _exit_hard():
    import os

    if dist.get_rank() == 0:
        os._exit(7)
    return "ok"


def test_harness_reports_a_dead_rank():
    with pytest.raises(DistributedTestError, match="rank 0 died with exit code 7"):
        run_distributed(_exit_hard, 2, timeout=20)
