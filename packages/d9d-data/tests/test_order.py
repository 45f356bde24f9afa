"""The global sample order: a seeded O(1)-memory bijection of [0, n), its quality and its memory."""

import tracemalloc

import numpy as np
import pytest

from d9d.data import EpochOrder, epoch_order

PRIME = 65_521  # the largest prime below 2**16


def _all(order: EpochOrder) -> np.ndarray:
    return order.indices(np.arange(len(order)))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 4096, 4097, PRIME, 2**16 + 1, 99_991])
@pytest.mark.parametrize("seed", [0, 7])
def test_is_a_bijection_of_0_to_n(n, seed):
    for epoch in (0, 3):
        indices = _all(epoch_order(n, seed=seed, epoch=epoch))
        assert indices.dtype == np.int64
        assert np.array_equal(np.sort(indices), np.arange(n))


def test_is_deterministic_per_seed_and_epoch_and_differs_otherwise():
    base = _all(epoch_order(1000, seed=3, epoch=0))
    assert np.array_equal(base, _all(epoch_order(1000, seed=3, epoch=0)))
    assert epoch_order(1000, seed=3, epoch=0) == epoch_order(1000, seed=3, epoch=0)
    others = [(3, 1), (3, 2), (4, 0), (0, 3)]  # (seed, epoch): (0, 3) is not (3, 0)
    for seed, epoch in others:
        other = _all(epoch_order(1000, seed=seed, epoch=epoch))
        # Two independent uniform permutations agree at ~1 position on average.
        assert int((other == base).sum()) < 10, (seed, epoch)


def test_without_shuffle_the_order_is_the_index_order():
    order = epoch_order(5, seed=3, epoch=7, shuffle=False)
    assert order[:].tolist() == [0, 1, 2, 3, 4]
    assert order.indices(np.array([4, 0])).tolist() == [4, 0]


@pytest.mark.parametrize("n", [100_000, 2**17 + 1])  # 2**17 + 1: the most cycle-walking (domain ~2n)
def test_shuffle_quality_is_that_of_a_uniform_random_permutation(n):
    """Loose bounds; measured at n = 10**6 over 10 seeds: |r| < 0.003, 0-2 fixed points, chi2 924-1056."""
    positions = np.arange(n)
    for seed in range(4):
        indices = _all(epoch_order(n, seed=seed, epoch=seed))
        # Correlations of a uniform permutation have a standard deviation of 1/sqrt(n) (~0.003 here).
        assert abs(np.corrcoef(positions, indices)[0, 1]) < 0.02
        assert abs(np.corrcoef(indices[:-1], indices[1:])[0, 1]) < 0.02
        # Fixed points: Poisson(1) for a uniform permutation.
        assert int((indices == positions).sum()) <= 8
        # Which part of the dataset each part of the epoch visits: ~uniform over a 16 x 16 grid
        # (about 225 degrees of freedom, standard deviation ~21).
        grid, _, _ = np.histogram2d(positions, indices, bins=16)
        expected = n / 256
        assert ((grid - expected) ** 2 / expected).sum() < 400


def test_every_index_is_equally_likely_at_a_position_over_epochs():
    firsts = np.array([epoch_order(10, seed=1, epoch=e)[0] for e in range(2000)])
    counts = np.bincount(firsts, minlength=10)
    assert ((counts - 200) ** 2 / 200).sum() < 40  # chi-square, 9 degrees of freedom (p ~ 1e-5)


def test_positions_can_be_given_in_any_shape_and_match_single_lookups():
    order = epoch_order(4097, seed=2, epoch=1)
    grid = np.array([[0, 5, 4096], [17, 17, 3]])
    got = order.indices(grid)
    assert got.shape == grid.shape
    assert got.tolist() == [[order[int(p)] for p in row] for row in grid]
    assert order[-1] == order[4096]
    assert order[10:20].tolist() == order.indices(np.arange(10, 20)).tolist()
    assert order[20:10:-3].tolist() == order.indices(np.arange(20, 10, -3)).tolist()


def test_positions_outside_the_order_are_errors():
    order = epoch_order(10, seed=0, epoch=0)
    with pytest.raises(IndexError, match=r"positions \[3, 10\] are outside an order of 10 samples"):
        order.indices(np.array([3, 10]))
    with pytest.raises(IndexError, match="position 10 is outside"):
        order[10]
    with pytest.raises(TypeError, match="must be integers"):
        order.indices(np.array([1.0]))
    with pytest.raises(ValueError, match="seed and epoch must be >= 0"):
        epoch_order(10, seed=-1, epoch=0)


def test_a_global_batch_deep_into_two_billion_samples_allocates_nothing_of_size_n():
    n, gbs = 2_000_000_000, 4096
    tracemalloc.start()
    try:
        order = epoch_order(n, seed=0, epoch=5)
        batch = order.indices(np.arange(1_000_000_000, 1_000_000_000 + gbs))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes traced; a permutation would be {8 * n} bytes"  # ~15 arrays of gbs
    assert len(np.unique(batch)) == gbs and batch.min() >= 0 and batch.max() < n
    assert batch[:3].tolist() == [order[1_000_000_000 + i] for i in range(3)]
    # Spread over the whole dataset, not a neighbourhood of the position.
    assert batch.min() < n // 8 and batch.max() > n - n // 8
