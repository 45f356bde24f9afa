"""Pipeline × data parallelism (PP 2 × FSDP 2, × DDP 2, × HSDP 2×2) trains like one process.

Includes the regression test for zero-bubble schedules under FSDP2: with FSDP's default resharding
after forward, torch 2.15 accumulates wrong weight gradients; `Pipeline` turns the resharding off.
"""

import pytest
import torch
from _pipeline_model import RunResult, assert_same_run, pipeline_run, reference_run

import d9d.parallel.pipeline.runtime as pipeline_runtime
from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import PipelineConfig

PP2_FSDP2 = MeshConfig(pipeline_parallel=2, data_parallel_shard=2)
PP2_DDP2 = MeshConfig(pipeline_parallel=2, data_parallel_replicate=2)


@pytest.fixture(scope="module")
def reference():
    return {opt: run_distributed(reference_run, 1, opt)[0] for opt in ("sgd", "adamw")}


@pytest.mark.parametrize(
    ("schedule", "optimizer", "reshard_after_forward"),
    [
        ("1f1b", "sgd", None),
        ("1f1b", "adamw", True),
        ("gpipe", "sgd", None),
        ("interleaved_1f1b", "sgd", None),
        ("looped_bfs", "sgd", None),
        # the zero-bubble schedules: FSDP's default (blocks reshard after forward) or an explicit
        # True must both be made safe by the pipeline's guard
        ("interleaved_zero_bubble", "sgd", None),
        ("zbv", "sgd", None),
        ("zbv", "adamw", True),
        ("dualpipev", "sgd", None),
    ],
)
def test_pp2_fsdp2_matches_one_process_4ranks(reference, schedule, optimizer, reshard_after_forward):
    ranks = run_distributed(
        pipeline_run,
        4,
        PP2_FSDP2,
        PipelineConfig(schedule),
        4,
        optimizer=optimizer,
        data_parallel="fsdp",
        reshard_after_forward=reshard_after_forward,
    )
    tol = 1e-5 if optimizer == "sgd" else 1e-4
    assert_same_run(ranks, reference[optimizer], rtol=tol, atol=tol)


def test_pp2_fsdp2_stages_built_on_meta_4ranks(reference):
    ranks = run_distributed(
        pipeline_run,
        4,
        PP2_FSDP2,
        PipelineConfig("interleaved_1f1b"),
        2,
        data_parallel="fsdp",
        meta_init=True,
    )
    assert_same_run(ranks, reference["sgd"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pp2_ddp2_matches_one_process_4ranks(reference, schedule):
    ranks = run_distributed(pipeline_run, 4, PP2_DDP2, PipelineConfig(schedule), 4, data_parallel="replicate")
    assert_same_run(ranks, reference["sgd"], rtol=1e-5, atol=1e-5)


def test_pp2_hsdp_2x2_zero_bubble_matches_one_process_8ranks(reference):
    mesh = MeshConfig(pipeline_parallel=2, data_parallel_replicate=2, data_parallel_shard=2)
    ranks = run_distributed(pipeline_run, 8, mesh, PipelineConfig("zbv"), 2, data_parallel="hsdp")
    assert_same_run(ranks, reference["sgd"], rtol=1e-5, atol=1e-5)


def _unguarded_run(*args: object, **kwargs: object) -> RunResult:
    pipeline_runtime.prepare_fsdp_for_schedule = lambda module, config: 0  # forked rank only
    return pipeline_run(*args, **kwargs)  # type: ignore[arg-type]


def test_zero_bubble_fsdp_guard_is_what_makes_it_correct_4ranks(reference):
    """Without the guard the same run drifts from one process (if this fails, torch fixed it: the guard
    in `prepare_fsdp_for_schedule` may then be dropped for that torch version)."""
    ranks = run_distributed(_unguarded_run, 4, PP2_FSDP2, PipelineConfig("zbv"), 4, data_parallel="fsdp")
    want = reference["sgd"]
    drift = max(
        float((got.params[name] - value).abs().max())
        for got in ranks
        for name, value in want.params.items()
        if name in got.params
    )
    loss_drift = float((torch.tensor(ranks[0].losses) - torch.tensor(want.losses)).abs().max())
    assert max(drift, loss_drift) > 1e-4, "zbv + FSDP2 resharding after forward now matches one process"
