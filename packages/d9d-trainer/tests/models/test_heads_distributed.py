"""The reference model's score head on meshes (forked gloo ranks on CPU) gives one process's scores on
the same weights: FSDP 2 and TP 2 through the trainer (`d9d.trainer:HFModelProvider` reading a
classifier folder; under TP the head is replicated and the sequence-parallel hidden states gathered
before pooling), PP 2 through `d9d.parallel.pipeline.Pipeline.forward_only` (the last stage holds the
head and finds the padding from the `tokens` every stage is given)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from _heads import PAD, randomize_
from _heads import padded_batch as _padded
from _job import job_config

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import Pipeline, plan_pipeline
from d9d.trainer import Trainer
from d9d.trainer.models import (
    ClassificationHead,
    ReferenceModelConfig,
    build_reference_model,
    save_hf_pretrained,
)
from d9d.trainer.models.parallelize import trim_to_stage

CONFIG = ReferenceModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, head=ClassificationHead(num_labels=3, pad_token_id=PAD),
)  # fmt: skip


def classifier() -> torch.nn.Module:
    """The classifier every process builds alike."""
    torch.manual_seed(0)
    return randomize_(build_reference_model(CONFIG))


def padded_batch() -> torch.Tensor:
    return _padded(64, seq=8)


def _trainer_scores(config: dict) -> torch.Tensor:
    with Trainer.from_config(config) as trainer:
        trainer.resume()  # the folder's weights
        trainer.model.eval()
        with torch.no_grad():
            return trainer.model(padded_batch()).detach().clone()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cls")
    save_hf_pretrained(classifier(), path)
    return path


@pytest.mark.parametrize("mesh", [{"data_parallel_shard": 2}, {"tensor_parallel": 2}], ids=["fsdp2", "tp2"])
def test_score_head_on_a_mesh_gives_one_process_scores(tmp_path, folder, mesh):
    with torch.no_grad():
        expected = classifier()(padded_batch())
    config = job_config(str(tmp_path), mesh=mesh)
    config["providers"]["model"] = "d9d.trainer:HFModelProvider"
    config["model"] = {"hf_folder": str(folder), "backend": "reference",
                       "head": {"kind": "classification", "num_labels": 3}}  # fmt: skip
    for got in run_distributed(_trainer_scores, 2, config, timeout=120):
        assert got.shape == (4, 3) and expected.std() > 0.5
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _pipeline_scores() -> torch.Tensor | None:
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=2)) as ctx:
        layout = plan_pipeline(CONFIG.num_layers, 2, n_microbatches=2)
        modules = []
        for spec in layout.stages_of_rank(ctx.coordinate("pp")):
            stage = copy.deepcopy(classifier())
            trim_to_stage(stage, spec)
            modules.append(stage)
        pipe = Pipeline(layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=2, loss_fn=None)
        ids = padded_batch()
        micro = list(ids.chunk(2))
        with torch.no_grad():
            outputs = pipe.forward_only(micro, kwargs=[{"tokens": m} for m in micro])
        return None if outputs is None else torch.cat(outputs)


def test_score_head_on_the_last_pipeline_stage_gives_one_process_scores():
    with torch.no_grad():
        expected = classifier()(padded_batch())
    results = run_distributed(_pipeline_scores, 2, timeout=120)
    got = [r for r in results if r is not None]
    assert len(got) == 1  # the last stage's rank alone holds the scores
    torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-5)
