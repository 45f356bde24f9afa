import itertools

import pytest

from d9d.data import (
    BatchSizeError,
    DatasetError,
    advance_position,
    batch_size_choices,
    check_batch_sizes,
    check_dataset_size,
    epoch_order,
    microbatches_per_rank,
    rank_slice,
    step_sample_indices,
    steps_per_epoch,
)


@pytest.mark.parametrize(
    ("gbs", "mbs", "dp", "expected"),
    [(32, 4, 1, 8), (32, 4, 2, 4), (32, 4, 8, 1), (32, 1, 4, 8), (6, 3, 2, 1), (1, 1, 1, 1)],
)
def test_microbatches_per_rank_keeps_the_global_batch(gbs, mbs, dp, expected):
    n = microbatches_per_rank(gbs, mbs, dp)
    assert n == expected
    assert n * mbs * dp == gbs


@pytest.mark.parametrize(("gbs", "mbs", "dp"), [(30, 4, 4), (32, 3, 2), (10, 4, 1), (12, 2, 8), (7, 7, 2)])
def test_divisibility_error_names_the_three_numbers_and_valid_choices(gbs, mbs, dp):
    with pytest.raises(BatchSizeError) as info:
        check_batch_sizes(gbs, mbs, dp)
    message = str(info.value)
    assert f"data.global_batch_size={gbs}" in message
    assert f"data-parallel ranks ({dp})" in message
    assert f"data.microbatch_size ({mbs})" in message
    assert f"= {dp * mbs}" in message
    choices = batch_size_choices(gbs, mbs, dp)
    assert choices["global_batch_size"], "a multiple of dp × microbatch_size is always offered"
    for value in choices["global_batch_size"]:
        assert str(value) in message
        check_batch_sizes(value, mbs, dp)
    for value in choices["microbatch_size"]:
        check_batch_sizes(gbs, value, dp)
    for value in choices["data_parallel"]:
        check_batch_sizes(gbs, mbs, value)
    if choices["microbatch_size"]:
        assert f"data.microbatch_size to one of {choices['microbatch_size']}" in message


def test_divisibility_error_is_a_value_error_for_nonpositive_sizes():
    with pytest.raises(ValueError, match="must be >= 1"):
        check_batch_sizes(0, 1, 1)


@pytest.mark.parametrize(("gbs", "dp"), [(8, 1), (8, 2), (8, 4), (12, 3)])
def test_rank_slices_tile_the_global_batch(gbs, dp):
    slices = [rank_slice(gbs, dp, r) for r in range(dp)]
    assert slices[0][0] == 0 and slices[-1][1] == gbs
    for (_, hi), (lo, _) in itertools.pairwise(slices):
        assert hi == lo
    assert {hi - lo for lo, hi in slices} == {gbs // dp}
    with pytest.raises(ValueError):
        rank_slice(gbs, dp, dp)


@pytest.mark.parametrize(("n", "gbs"), [(100, 8), (96, 8), (9, 8), (8, 8)])
def test_steps_per_epoch_floor_with_drop_last_ceil_without(n, gbs):
    assert steps_per_epoch(n, gbs, drop_last=True) == n // gbs
    assert steps_per_epoch(n, gbs, drop_last=False) == -(-n // gbs)


def test_dataset_smaller_than_a_global_batch_is_a_clear_error():
    with pytest.raises(
        DatasetError, match=r"7 samples, fewer than one global batch \(data.global_batch_size=8\)"
    ):
        check_dataset_size(7, 8)
    with pytest.raises(DatasetError, match="at most 7"):
        steps_per_epoch(7, 8, drop_last=False)


def _walk(n, gbs, drop_last, steps):
    epoch, position, seen = 0, 0, []
    for _ in range(steps):
        seen.append((epoch, position))
        epoch, position = advance_position(
            epoch, position, num_samples=n, global_batch_size=gbs, drop_last=drop_last
        )
    return seen


def test_epoch_boundaries_with_and_without_drop_last():
    assert _walk(10, 4, True, 5) == [(0, 0), (0, 4), (1, 0), (1, 4), (2, 0)]
    assert _walk(10, 4, False, 5) == [(0, 0), (0, 4), (0, 8), (1, 0), (1, 4)]
    assert _walk(8, 4, False, 3) == [(0, 0), (0, 4), (1, 0)]
    # A position saved under another global batch size where no step fits starts the next epoch.
    assert advance_position(2, 9, num_samples=10, global_batch_size=4, drop_last=True) == (3, 0)


def test_without_drop_last_the_last_step_wraps_to_the_start_of_the_same_order():
    order = epoch_order(10, seed=0, epoch=0)
    last = step_sample_indices(order, 8, 0, 4)
    assert last.tolist() == [*order[8:10].tolist(), *order[0:2].tolist()]
    covered = set()
    for position in range(0, 10, 4):
        covered |= set(step_sample_indices(order, position, 0, 4).tolist())
    assert covered == set(range(10))
