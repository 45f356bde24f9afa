"""AutoDataProvider on real ranks (forked gloo processes), each building its own DistributedContext."""

import pytest
import torch

from d9d.data import AutoDataConfig, AutoDataProvider, epoch_order
from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed

CONFIG = AutoDataConfig(global_batch_size=8, microbatch_size=2, seed=11)
NUM_SAMPLES = 20  # 2 steps per epoch: 5 steps cross two epoch boundaries


class IndexDataset:
    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        return torch.tensor(index)


def _rank_steps(mesh, steps, state=None, pipeline_stages="all"):
    """On each rank: its coordinates, its samples per step and the final data state."""
    with DistributedContext.from_env(mesh) as ctx:
        provider = AutoDataProvider(CONFIG, IndexDataset(), context=ctx, pipeline_stages=pipeline_stages)
        if state is not None:
            provider.load_state_dict(state)
        samples = [[int(i) for mb in next(provider) for i in mb.tolist()] for _ in range(steps)]
        coords = {axis: ctx.coordinate(axis) for axis in ("pp", "dp", "tp")}
        return coords, samples, provider.state_dict()


def _global_batches(results, steps):
    """Concatenate, per step, the samples of one rank per DP coordinate, in DP order."""
    by_dp = {
        coords["dp"]: samples for coords, samples, _ in results if coords["pp"] == 0 and coords["tp"] == 0
    }
    return [[i for dp in sorted(by_dp) for i in by_dp[dp][s]] for s in range(steps)]


def _expected(steps, start=0):
    orders = [epoch_order(NUM_SAMPLES, seed=CONFIG.seed, epoch=e)[:].tolist() for e in range(4)]
    return [orders[s // 2][(s % 2) * 8 : (s % 2) * 8 + 8] for s in range(start, start + steps)]


@pytest.mark.parametrize(
    "mesh",
    [
        MeshConfig(),
        MeshConfig(data_parallel_shard=2),
        MeshConfig(data_parallel_replicate=2, data_parallel_shard=2),
    ],
    ids=["dp1", "dp2", "dp4-hsdp"],
)
def test_union_of_ranks_is_the_global_batch_world_1_2_4(mesh):
    results = run_distributed(_rank_steps, mesh.world_size, mesh, 5)
    assert _global_batches(results, 5) == _expected(5)
    for _, samples, _ in results:
        assert all(len(s) == 8 // mesh.data_parallel for s in samples)


def test_tensor_parallel_peers_get_identical_data_world_4():
    mesh = MeshConfig(data_parallel_shard=2, tensor_parallel=2)
    results = run_distributed(_rank_steps, 4, mesh, 3)
    for dp in (0, 1):
        peers = [samples for coords, samples, _ in results if coords["dp"] == dp]
        assert len(peers) == 2 and peers[0] == peers[1]
    assert _global_batches(results, 3) == _expected(3)


def test_only_consuming_pipeline_stages_load_world_4():
    mesh = MeshConfig(pipeline_parallel=2, data_parallel_shard=2)
    results = run_distributed(_rank_steps, 4, mesh, 3, None, "first")
    for coords, samples, state in results:
        if coords["pp"] == 0:
            assert all(len(s) == 4 for s in samples)
        else:
            assert samples == [[], [], []]
        assert (state["epoch"], state["position"]) == (1, 8)
    assert _global_batches(results, 3) == _expected(3)


def test_resume_on_another_dp_degree_world_2_to_4():
    _, _, state = run_distributed(_rank_steps, 2, MeshConfig(data_parallel_shard=2), 3)[0]
    results = run_distributed(_rank_steps, 4, MeshConfig(data_parallel_shard=4), 3, state)
    assert _global_batches(results, 3) == _expected(3, start=3)
