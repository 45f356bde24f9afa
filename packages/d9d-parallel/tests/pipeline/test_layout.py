"""Layer-to-stage splits and stage-to-rank maps: pure arithmetic, checked against brute force and torch."""

import itertools

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from d9d.mesh import D9dError
from d9d.parallel.pipeline import (
    PIPELINE_SCHEDULES,
    PipelineConfig,
    PipelineError,
    plan_pipeline,
    split_layers,
    stage_to_rank,
)


def _weights(sizes: tuple[int, ...], emb: float, head: float) -> list[float]:
    w = [float(n) for n in sizes]
    w[0] += emb
    w[-1] += head
    return w


def _valid(sizes: tuple[int, ...], emb: float, head: float) -> bool:
    last = len(sizes) - 1
    for s, n in enumerate(sizes):
        has_extra = (s == 0 and emb > 0) or (s == last and head > 0)
        if n == 0 and not has_extra and len(sizes) > 1:
            return False
    return True


def _all_splits(num_layers: int, num_stages: int):
    for cuts in itertools.combinations_with_replacement(range(num_layers + 1), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


CASES = [
    (n, s, emb, head)
    for n in range(0, 8)
    for s in range(1, 5)
    for emb, head in [(1.0, 1.0), (0.0, 0.0), (0.5, 2.0), (3.0, 0.0)]
]


@pytest.mark.parametrize(("num_layers", "num_stages", "emb", "head"), CASES)
def test_split_is_an_optimal_contiguous_cover(num_layers, num_stages, emb, head):
    candidates = [c for c in _all_splits(num_layers, num_stages) if _valid(c, emb, head)]
    if not candidates:
        with pytest.raises(PipelineError, match="cannot split"):
            split_layers(num_layers, num_stages, embedding_weight=emb, head_weight=head)
        return
    ranges = split_layers(num_layers, num_stages, embedding_weight=emb, head_weight=head)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, complete
    sizes = tuple(len(r) for r in ranges)
    assert _valid(sizes, emb, head)
    # the heaviest stage is as light as possible, then the squared weights are as small as possible
    best_max = min(max(_weights(c, emb, head)) for c in candidates)
    assert max(_weights(sizes, emb, head)) == pytest.approx(best_max)
    tight = [c for c in candidates if max(_weights(c, emb, head)) <= best_max + 1e-9]
    best_sq = min(sum(w * w for w in _weights(c, emb, head)) for c in tight)
    assert sum(w * w for w in _weights(sizes, emb, head)) == pytest.approx(best_sq)
    # among equally good splits, later stages get the extra layers
    equal = [c for c in tight if sum(w * w for w in _weights(c, emb, head)) <= best_sq + 1e-9]
    assert sizes == min(equal)


def test_split_refuses_bad_arguments():
    with pytest.raises(PipelineError, match="at least one stage"):
        split_layers(4, 0)
    with pytest.raises(PipelineError, match=">= 0"):
        split_layers(4, 2, embedding_weight=-1.0)
    with pytest.raises(PipelineError, match="cannot split 2 layers into 5"):
        split_layers(2, 5)


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("per_rank", [1, 2, 3])
def test_loop_mapping_matches_torch(pp_size, per_rank):
    num_stages = pp_size * per_rank
    want = generate_stage_to_rank_mapping(pp_size, num_stages, style="loop")
    assert stage_to_rank(num_stages, pp_size, "loop") == tuple(want[s] for s in range(num_stages))


@pytest.mark.parametrize("pp_size", [1, 2, 3, 4, 8])
def test_v_mapping_matches_torch(pp_size):
    num_stages = 2 * pp_size
    want = generate_stage_to_rank_mapping(pp_size, num_stages, style="v")
    got = stage_to_rank(num_stages, pp_size, "v")
    assert got == tuple(want[s] for s in range(num_stages))
    assert got[0] == got[-1] == 0  # the first and last stage share rank 0: the V's two tips


def test_mapping_refuses_uneven_or_non_v_counts():
    with pytest.raises(PipelineError, match="evenly"):
        stage_to_rank(5, 2)
    with pytest.raises(PipelineError, match="exactly 2 stages per rank"):
        stage_to_rank(6, 2, "v")
    with pytest.raises(PipelineError, match="style"):
        stage_to_rank(4, 2, "zigzag")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", list(PIPELINE_SCHEDULES))
@pytest.mark.parametrize("pp_size", [1, 2, 4])
def test_plan_gives_every_rank_its_stages(name, pp_size):
    config = PipelineConfig(name)
    layout = plan_pipeline(16, pp_size, config)
    per_rank = config.resolved_stages_per_rank
    assert layout.num_stages == pp_size * per_rank
    assert layout.stages_per_rank == per_rank
    assert [s.index for s in layout.stages] == list(range(layout.num_stages))
    assert layout.stages[0].is_first and layout.stages[-1].is_last
    assert sum(s.is_first or s.is_last for s in layout.stages) == (1 if layout.num_stages == 1 else 2)
    expected_ranks = stage_to_rank(layout.num_stages, pp_size, config.info.style)
    for rank in range(pp_size):
        mine = layout.stages_of_rank(rank)
        assert len(mine) == per_rank
        assert all(expected_ranks[s.index] == rank == s.rank for s in mine)
        assert [s.index for s in mine] == sorted(s.index for s in mine)
    assert [i for s in layout.stages for i in s.layers] == list(range(16))
    assert f"stage {layout.num_stages - 1}" in layout.describe()


def test_plan_checks_ranks_and_microbatches():
    layout = plan_pipeline(4, 2)
    with pytest.raises(PipelineError, match="outside"):
        layout.stages_of_rank(2)
    with pytest.raises(PipelineError, match="at least as many microbatches"):
        plan_pipeline(4, 2, PipelineConfig("1f1b"), n_microbatches=1)
    with pytest.raises(PipelineError, match="pp_size"):
        plan_pipeline(4, 0)


def test_errors_are_d9d_errors():
    assert issubclass(PipelineError, D9dError)
    assert issubclass(PipelineError, ValueError)
