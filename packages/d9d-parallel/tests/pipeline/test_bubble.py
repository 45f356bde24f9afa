"""The pipeline schedules' theoretical bubble: the formulas, and looped BFS against a simulated schedule."""

from fractions import Fraction

import pytest

from d9d.parallel.pipeline import pipeline_bubble


def test_bubble_of_gpipe_1f1b_and_interleaved_1f1b():
    # p ranks, m microbatches: GPipe and 1F1B (p−1)/(m+p−1); interleaved over v stages: (p−1)/(v·m+p−1)
    assert pipeline_bubble("1f1b", 4, 1, 8).fraction == Fraction(3, 11)
    assert pipeline_bubble("gpipe", 4, 1, 8).fraction == Fraction(3, 11)
    assert pipeline_bubble("interleaved_1f1b", 4, 2, 8).fraction == Fraction(3, 19)
    assert pipeline_bubble("interleaved_1f1b", 4, 4, 8).fraction == Fraction(3, 35)
    assert pipeline_bubble("1f1b", 2, 1, 4).formula == "(p−1)/(m+p−1)"


def _looped_forward_span(p: int, v: int, m: int) -> int:
    """Time units of looped BFS's forward pass, simulated: a stage takes 1 unit per microbatch, stage s
    runs on rank s mod p, and each rank runs all microbatches of one of its stages before its next."""
    done: dict[tuple[int, int], int] = {}
    free = [0] * p
    for stage in range(p * v):
        rank = stage % p
        for mb in range(m):
            start = max(free[rank], done.get((stage - 1, mb), 0))
            done[stage, mb] = free[rank] = start + 1
    return max(done.values())


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (4, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 2), (3, 2, 1)])
def test_looped_bubble_matches_a_simulated_schedule(p, v, m):
    span = _looped_forward_span(p, v, m)  # the forward; the backward mirrors it
    simulated = Fraction(span - v * m, span)  # every rank works v · m units
    assert pipeline_bubble("looped_bfs", p, v, m).fraction == simulated
    if v == 1:
        assert pipeline_bubble("gpipe", p, 1, m).fraction == simulated


def test_zero_bubble_schedules_need_a_microbatch_per_stage():
    for schedule in ("interleaved_zero_bubble", "zbv", "dualpipev"):
        assert pipeline_bubble(schedule, 4, 2, 8).fraction == 0
        assert pipeline_bubble(schedule, 4, 2, 7).fraction is None
