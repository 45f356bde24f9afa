"""AutoDataProvider in one process: ranks are simulated with `DataPlacement` (real ranks: test_distributed)."""

import random
import tracemalloc

import numpy as np
import pytest
import torch

from d9d.data import (
    AutoDataConfig,
    AutoDataProvider,
    BatchSizeError,
    DataConfigError,
    DataPlacement,
    DataProvider,
    DatasetError,
    DataStateError,
    SizedDataProvider,
    epoch_order,
)
from d9d.mesh import DistributedContext, MeshConfig


class IndexDataset:
    """Sample i is the int64 tensor [i]: batches show exactly which samples they hold."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.tensor(index)


def _flatten(step):
    return [int(i) for mb in step for i in mb.tolist()]


def _global_batches(config, n, dp, steps, state=None):
    """Per step, the concatenation of every simulated DP rank's samples (rank order)."""
    providers = [
        AutoDataProvider(config, IndexDataset(n), context=DataPlacement(dp_rank=r, dp_size=dp))
        for r in range(dp)
    ]
    if state is not None:
        for p in providers:
            p.load_state_dict(state)
    batches = [[i for p in providers for i in _flatten(next(p))] for _ in range(steps)]
    return batches, providers[0].state_dict()


def test_each_rank_gets_its_microbatches_of_microbatch_size():
    config = AutoDataConfig(global_batch_size=16, microbatch_size=2)
    provider = AutoDataProvider(config, IndexDataset(50), context=DataPlacement(dp_rank=1, dp_size=2))
    step = next(provider)
    assert provider.microbatches_per_step == len(step) == 4
    assert all(mb.shape == (2,) for mb in step)
    assert _flatten(step) == epoch_order(50, seed=0, epoch=0)[8:16].tolist()


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_do_not_depend_on_the_dp_degree(drop_last):
    config = AutoDataConfig(global_batch_size=8, microbatch_size=2, seed=5, drop_last=drop_last)
    reference, _ = _global_batches(config, 30, 1, 10)  # 10 steps cross two epoch boundaries
    for dp in (2, 4):
        assert _global_batches(config, 30, dp, 10)[0] == reference
    orders = [epoch_order(30, seed=5, epoch=e)[:].tolist() for e in range(4)]
    if drop_last:  # 3 steps per epoch, the last 6 positions of each order skipped
        expected = [orders[s // 3][(s % 3) * 8 : (s % 3) * 8 + 8] for s in range(10)]
    else:  # 4 steps per epoch, the 4th filled with the start of the same order
        expected = [(orders[s // 4] * 2)[(s % 4) * 8 : (s % 4) * 8 + 8] for s in range(10)]
    assert reference == expected


def test_without_shuffle_samples_come_in_index_order():
    config = AutoDataConfig(global_batch_size=4, microbatch_size=2, shuffle=False)
    batches, _ = _global_batches(config, 10, 2, 3)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("stop", [2, 3, 7])  # mid-epoch, exactly at the epoch boundary, in epoch 2
def test_resume_continues_with_exactly_the_next_global_batch(stop):
    config = AutoDataConfig(global_batch_size=6, microbatch_size=3, seed=1)
    reference, _ = _global_batches(config, 20, 2, 10)
    _, state = _global_batches(config, 20, 2, stop)
    assert state["epoch"] == stop // 3 and state["position"] == (stop % 3) * 6
    resumed, _ = _global_batches(config, 20, 2, 10 - stop, state=state)
    assert resumed == reference[stop:]


@pytest.mark.parametrize(("dp_before", "dp_after"), [(1, 2), (2, 4), (4, 1)])
def test_resume_with_another_dp_degree(dp_before, dp_after):
    config = AutoDataConfig(global_batch_size=8, microbatch_size=1, seed=2)
    reference, _ = _global_batches(config, 28, 1, 9)
    _, state = _global_batches(config, 28, dp_before, 4)
    resumed, _ = _global_batches(config, 28, dp_after, 5, state=state)
    assert resumed == reference[4:]


def test_a_state_from_another_order_is_refused():
    config = AutoDataConfig(global_batch_size=4)
    provider = AutoDataProvider(config, IndexDataset(20))
    next(provider)
    state = provider.state_dict()
    other_seed = AutoDataProvider(AutoDataConfig(global_batch_size=4, seed=9), IndexDataset(20))
    with pytest.raises(DataStateError, match=r"seed: saved 0, now 9.*restore the dataset"):
        other_seed.load_state_dict(state)
    with pytest.raises(DataStateError, match="num_samples: saved 20, now 21"):
        AutoDataProvider(config, IndexDataset(21)).load_state_dict(state)
    with pytest.raises(DataStateError, match=r"lacks \['position'\]"):
        provider.load_state_dict({k: v for k, v in state.items() if k != "position"})


def test_a_state_written_with_the_old_materialized_permutation_is_refused():
    provider = AutoDataProvider(AutoDataConfig(global_batch_size=4), IndexDataset(20))
    state = provider.state_dict()
    assert state["version"] == 2
    with pytest.raises(DataStateError) as info:
        provider.load_state_dict({**state, "version": 1})
    message = str(info.value)
    assert "\n" not in message
    assert "version 1, whose sample order was a full numpy permutation" in message
    assert "start a new run" in message
    with pytest.raises(DataStateError, match="has version 3, but this d9d-data reads version 2"):
        provider.load_state_dict({**state, "version": 3})
    with pytest.raises(DataStateError, match=r"lacks \['version'\]"):
        provider.load_state_dict({k: v for k, v in state.items() if k != "version"})


def test_two_billion_samples_resume_deep_into_an_epoch_without_a_permutation():
    n = 2_000_000_000
    config = AutoDataConfig(global_batch_size=64, microbatch_size=8, seed=3)
    placements = [DataPlacement(dp_rank=r, dp_size=4) for r in range(4)]
    state = {**AutoDataProvider(config, IndexDataset(n)).state_dict(), "position": 1_000_000_000}
    tracemalloc.start()
    try:
        steps = []
        for placement in placements:
            provider = AutoDataProvider(config, IndexDataset(n), context=placement)
            provider.load_state_dict(state)
            steps.append(_flatten(next(provider)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak} bytes traced; a permutation would be {8 * n} bytes"
    order = epoch_order(n, seed=3, epoch=0)
    assert [i for step in steps for i in step] == order[1_000_000_000:1_000_000_064].tolist()


def test_pinned_batches_by_default_only_for_a_cuda_device(monkeypatch):
    config = AutoDataConfig(global_batch_size=4)
    cpu = AutoDataProvider(config, IndexDataset(8), device="cpu")
    assert (cpu.device, cpu.pin_memory) == (torch.device("cpu"), False)
    assert AutoDataProvider(config, IndexDataset(8)).device is None
    with DistributedContext.from_env(MeshConfig()) as ctx:  # local mode on this CPU machine
        assert AutoDataProvider(config, IndexDataset(8), context=ctx).device == ctx.device
    # With CUDA usable (pretended here: the DataLoader is not built), "auto" follows the device.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert AutoDataProvider(config, IndexDataset(8), device="cuda:0").pin_memory
    assert not AutoDataProvider(config, IndexDataset(8), device="cpu").pin_memory
    assert not AutoDataProvider(config, IndexDataset(8)).pin_memory
    off = AutoDataConfig(global_batch_size=4, pin_memory=False)
    assert not AutoDataProvider(off, IndexDataset(8), device="cuda:0").pin_memory
    on = AutoDataConfig(global_batch_size=4, pin_memory=True)
    assert AutoDataProvider(on, IndexDataset(8)).pin_memory


def test_workers_give_the_same_stream_as_the_main_process():
    kwargs = {"global_batch_size": 8, "microbatch_size": 2, "seed": 4}
    plain = AutoDataProvider(AutoDataConfig(**kwargs), IndexDataset(20), context=DataPlacement(1, 2))
    expected = [_flatten(next(plain)) for _ in range(6)]
    config = AutoDataConfig(**kwargs, num_workers=2, prefetch=3)
    with AutoDataProvider(config, IndexDataset(20), context=DataPlacement(1, 2)) as workers:
        assert [_flatten(next(workers)) for _ in range(3)] == expected[:3]
        state = workers.state_dict()  # prefetched batches do not count as consumed
        assert [_flatten(next(workers)) for _ in range(3)] == expected[3:]
        workers.load_state_dict(state)
        assert [_flatten(next(workers)) for _ in range(3)] == expected[3:]


class WorkerDraws(IndexDataset):
    """Sample i is [i, a draw of torch's, numpy's and Python's generators] where it is loaded."""

    def __getitem__(self, index):
        draws = [float(torch.rand(())), float(np.random.rand()), random.random()]
        return torch.tensor([float(index), *draws], dtype=torch.float64)


def _worker_draws(placement, stages="all", steps=3):
    """The generator draws of the samples the rank's 2 loader workers load in `steps` steps."""
    config = AutoDataConfig(global_batch_size=8, microbatch_size=2, seed=11, num_workers=2, prefetch=1)
    with AutoDataProvider(config, WorkerDraws(20), context=placement, pipeline_stages=stages) as data:
        return [v for _ in range(steps) for mb in next(data) for v in mb[:, 1:].flatten().tolist()]


def test_loader_workers_draw_per_data_parallel_rank():
    # (a placement is what a rank's DistributedContext gives; forked test ranks are daemonic and
    # cannot start loader workers)
    dp0, dp1 = (_worker_draws(DataPlacement(r, 2)) for r in (0, 1))
    assert len(set(dp0)) == len(dp0)  # each sample its own draws: other workers, other positions
    assert not set(dp0) & set(dp1)  # data-parallel ranks draw other numbers
    assert _worker_draws(DataPlacement(0, 2)) == dp0  # the same rank again (or a tensor-parallel peer)
    # the first and the last pipeline stage load the same samples: the same draws
    first, last = (_worker_draws(DataPlacement(0, 2, p, 2), "first_and_last") for p in (0, 1))
    assert first == last == dp0


def test_pipeline_ranks_without_data_load_nothing_but_keep_the_same_state():
    class Untouchable(IndexDataset):
        def __getitem__(self, index):
            raise AssertionError("a pipeline rank that consumes no data read a sample")

    config = AutoDataConfig(global_batch_size=4, microbatch_size=2)
    for stages, loading in (
        ("first", {0}),
        ("last", {2}),
        ("first_and_last", {0, 2}),
        ({1}, {1}),
        ("all", {0, 1, 2}),
    ):
        for pp_rank in range(3):
            placement = DataPlacement(pp_rank=pp_rank, pp_size=3)
            dataset = IndexDataset(9) if pp_rank in loading else Untouchable(9)
            provider = AutoDataProvider(config, dataset, context=placement, pipeline_stages=stages)
            assert provider.loads_data == (pp_rank in loading)
            steps = [next(provider) for _ in range(3)]
            assert all(len(s) == (2 if pp_rank in loading else 0) for s in steps)
            assert (provider.epoch, provider.position) == (1, 4)
    with pytest.raises(DataConfigError, match=r"\[3\] do not exist"):
        AutoDataProvider(config, IndexDataset(9), context=DataPlacement(pp_size=3), pipeline_stages=[3])
    with pytest.raises(DataConfigError, match="is not one of"):
        AutoDataProvider(config, IndexDataset(9), pipeline_stages="middle")


def test_start_up_errors():
    with pytest.raises(BatchSizeError, match=r"data\.global_batch_size=10 is not divisible"):
        AutoDataProvider(
            AutoDataConfig(global_batch_size=10, microbatch_size=2),
            IndexDataset(100),
            context=DataPlacement(0, 4),
        )
    with pytest.raises(DatasetError, match="the dataset has 5 samples, fewer than one global batch"):
        AutoDataProvider(AutoDataConfig(global_batch_size=8), IndexDataset(5))


def test_length_and_protocols():
    provider = AutoDataProvider(AutoDataConfig(global_batch_size=4, drop_last=False), IndexDataset(10))
    assert len(provider) == provider.steps_per_epoch == 3
    assert isinstance(provider, SizedDataProvider)

    class Repeat:
        """A custom provider: one fixed microbatch per step."""

        def __init__(self):
            self.steps = 0

        def __iter__(self):
            while True:
                self.steps += 1
                yield [torch.zeros(2)]

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    assert isinstance(Repeat(), DataProvider)
    assert not isinstance(Repeat(), SizedDataProvider)
