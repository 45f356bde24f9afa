"""Schedules by name: stages per rank and microbatch counts are checked before any process group exists."""

import pytest
import torch.distributed.pipelining as tpp

from d9d.parallel.pipeline import (
    PIPELINE_SCHEDULES,
    PipelineConfig,
    PipelineError,
    check_pipeline_microbatches,
    fsdp_reshard_after_forward,
    pipeline_schedule_info,
)

NAMES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]


def test_every_documented_schedule_is_known_and_runs_on_torch():
    assert list(PIPELINE_SCHEDULES) == NAMES
    for name in NAMES:
        info = pipeline_schedule_info(name)
        assert info.torch_class is getattr(tpp, info.torch_class.__name__)
        # torch's single-stage classes take one stage, the multi-stage ones a list
        assert info.multi_stage == (not issubclass(info.torch_class, tpp.schedules.PipelineScheduleSingle))


def test_unknown_schedule_names_the_choices():
    with pytest.raises(PipelineError, match=r"unknown pipeline schedule 'zb'.*interleaved_zero_bubble"):
        PipelineConfig("zb")


@pytest.mark.parametrize(
    ("name", "bad", "need"),
    [
        ("gpipe", 2, "exactly 1"),
        ("1f1b", 3, "exactly 1"),
        ("zbv", 1, "exactly 2"),
        ("dualpipev", 4, "exactly 2"),
        ("interleaved_1f1b", 0, "positive integer"),
        ("looped_bfs", -1, "positive integer"),
    ],
)
def test_stages_per_rank_is_checked_per_schedule(name, bad, need):
    with pytest.raises(PipelineError, match=need):
        PipelineConfig(name, stages_per_rank=bad)


@pytest.mark.parametrize("name", NAMES)
def test_default_stages_per_rank_is_accepted(name):
    config = PipelineConfig(name)
    info = config.info
    assert config.resolved_stages_per_rank == info.default_stages_per_rank
    assert info.min_stages_per_rank <= config.resolved_stages_per_rank
    assert info.style == ("v" if name in ("zbv", "dualpipev") else "loop")


def test_interleaved_schedules_take_any_positive_stage_count():
    for name in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble"):
        for n in (1, 2, 3, 5):
            assert PipelineConfig(name, n).resolved_stages_per_rank == n


def test_microbatch_counts():
    check_pipeline_microbatches(PipelineConfig("gpipe"), 4, 1)
    check_pipeline_microbatches(PipelineConfig("1f1b"), 4, 4)
    with pytest.raises(PipelineError, match="3 microbatches < 4 stages"):
        check_pipeline_microbatches(PipelineConfig("1f1b"), 4, 3)
    with pytest.raises(PipelineError, match="< 8 stages"):
        check_pipeline_microbatches(PipelineConfig("dualpipev"), 4, 7)
    check_pipeline_microbatches(PipelineConfig("interleaved_1f1b"), 2, 3)  # one round of 3
    check_pipeline_microbatches(PipelineConfig("interleaved_1f1b"), 2, 6)
    with pytest.raises(PipelineError, match="divisible by"):
        check_pipeline_microbatches(PipelineConfig("interleaved_zero_bubble"), 2, 5)
    with pytest.raises(PipelineError, match="at least one microbatch"):
        check_pipeline_microbatches(PipelineConfig("gpipe"), 2, 0)


def test_fsdp_reshard_after_forward_is_off_only_for_zero_bubble():
    for name in NAMES:
        want = False if name in ("interleaved_zero_bubble", "zbv", "dualpipev") else None
        assert fsdp_reshard_after_forward(PipelineConfig(name)) is want
        assert PIPELINE_SCHEDULES[name].zero_bubble == (want is False)
