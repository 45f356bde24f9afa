"""The keys of training's random streams (`d9d.trainer.step.randomness`), in one process: what each
stream depends on and what it must not depend on. Real ranks: tests/test_randomness_e2e.py."""

import random

import numpy as np
import torch

from d9d.trainer.step.randomness import TrainingRandomness, stream_seed


def _microbatch_draw(streams: TrainingRandomness, step: int, index: int, per_rank: int) -> list[float]:
    streams.seed_microbatch(step, index, per_rank)
    return torch.rand(4).tolist()


def test_a_microbatch_draws_by_its_place_in_the_global_batch_on_any_data_parallel_degree():
    # 4 microbatches per global batch: 1 rank runs 4, 2 ranks 2 each, 4 ranks 1 each
    for step in (1, 7):
        one = [_microbatch_draw(TrainingRandomness(3), step, i, 4) for i in range(4)]
        assert len({tuple(d) for d in one}) == 4  # every microbatch its own masks
        for dp in (2, 4):
            per_rank = 4 // dp
            ranks = [
                _microbatch_draw(TrainingRandomness(3, dp_index=r), step, i, per_rank)
                for r in range(dp)
                for i in range(per_rank)
            ]
            assert ranks == one
    first = _microbatch_draw(TrainingRandomness(3), 1, 0, 4)
    assert _microbatch_draw(TrainingRandomness(3), 2, 0, 4) != first  # another step
    assert _microbatch_draw(TrainingRandomness(4), 1, 0, 4) != first  # another run seed
    # context-parallel ranks hold other positions of the same sequences: other masks
    assert _microbatch_draw(TrainingRandomness(3, cp_index=1), 1, 0, 4) != first
    # pipeline stages run other layers of the same microbatch: other masks
    TrainingRandomness(3).seed_microbatch(1, 0, 4, stage=1)
    assert torch.rand(4).tolist() != first


def _data_draws(streams: TrainingRandomness, step: int) -> tuple[list[float], float, float]:
    streams.seed_data(step)
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def test_the_data_stream_differs_per_data_parallel_rank_and_step_and_not_per_stage():
    first = _data_draws(TrainingRandomness(0, dp_index=0), 5)
    assert _data_draws(TrainingRandomness(0, dp_index=0), 5) == first  # a function of its key
    other_rank = _data_draws(TrainingRandomness(0, dp_index=1), 5)
    assert all(a != b for a, b in zip(other_rank, first, strict=True))  # torch, numpy and Python alike
    assert all(a != b for a, b in zip(_data_draws(TrainingRandomness(0), 6), first, strict=True))
    # pipeline and context-parallel ranks of one data-parallel group load the same data: alike
    assert _data_draws(TrainingRandomness(0, pp_index=1, cp_index=1), 5) == first


def test_each_pipeline_rank_draws_its_own_stream():
    draws = {}
    for dp in (0, 1):
        for pp in (0, 1):
            TrainingRandomness(0, dp_index=dp, pp_index=pp).seed_pipeline(3)
            draws[dp, pp] = tuple(torch.rand(4).tolist())
    assert len(set(draws.values())) == 4
    TrainingRandomness(0, dp_index=1, pp_index=1).seed_pipeline(3)
    assert tuple(torch.rand(4).tolist()) == draws[1, 1]


def test_stream_seeds_are_63_bit_and_keyed():
    keys = [(kind, step, place) for kind in range(3) for step in range(50) for place in range(8)]
    seeds = {stream_seed(0, *key) for key in keys}
    assert len(seeds) == 3 * 50 * 8
    assert all(0 <= s < 2**63 for s in seeds)
