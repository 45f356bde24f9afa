"""Trimming a whole model to one stage keeps whole-model names and only the stage's layers."""

import pytest
import torch
from _pipeline_model import StageModel, TinyConfig, trimmed_on_meta

from d9d.parallel.pipeline import (
    PipelineConfig,
    PipelineError,
    PipelineStageModule,
    keep_stage_layers,
    plan_pipeline,
)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_trimmed_stages_partition_the_whole_model(schedule):
    cfg = TinyConfig(n_layers=6)
    layout = plan_pipeline(cfg.n_layers, 2, PipelineConfig(schedule))
    whole = set(StageModel(cfg).state_dict())
    seen: list[str] = []
    for spec in layout.stages:
        stage = trimmed_on_meta(cfg, spec)
        assert isinstance(stage, PipelineStageModule)
        assert all(p.is_meta for p in stage.parameters())  # nothing materialized
        keys = set(stage.state_dict())
        assert keys == set(StageModel(cfg, spec).state_dict())
        assert [int(k) for k in stage.layers] == list(spec.layers)
        seen.extend(keys)
    assert sorted(seen) == sorted(whole)  # every parameter on exactly one stage


def test_keep_stage_layers_refuses_a_shorter_model():
    spec = plan_pipeline(8, 2).stages[1]
    with torch.device("meta"):
        model = StageModel(TinyConfig(n_layers=4))
    with pytest.raises(PipelineError, match="lacks"):
        keep_stage_layers(model.layers, spec)
