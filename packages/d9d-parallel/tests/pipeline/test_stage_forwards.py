"""`Pipeline.around_stage_forwards`: every stage forward runs inside the caller's context, named by its
stage and microbatch, on every schedule; torch's metadata-inference forward is marked as the probe.
Two forked ranks over gloo, 2 steps (the first with the probe: measured on torch 2.15, one per stage,
microbatch 0, on every schedule)."""

import contextlib

import pytest
import torch
from _pipeline_model import SCHEDULE_CASES, SEQ, TinyConfig, batches, build_stage, loss_fn
from torch.distributed.pipelining import PipelineStage

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel._torch_compat import around_stage_forward
from d9d.parallel.pipeline import Pipeline, PipelineConfig, plan_pipeline

#: torch 2.15 names each stage forward (`register_forward_context`); older ones give no such place and
#: `around_stage_forwards` says so (d9d then seeds the whole step instead).
HOOKED = hasattr(PipelineStage, "register_forward_context")

CASES = SCHEDULE_CASES


def _forwards() -> dict[str, list[list[tuple[int, int, bool]]]]:
    """Per case, per step: the (stage, microbatch, probe) of each forward context this rank entered."""
    cfg = TinyConfig()
    tokens = batches(cfg)
    positions = torch.arange(SEQ)
    seen: dict[str, list[list[tuple[int, int, bool]]]] = {}
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=2)) as ctx:
        for schedule, stages_per_rank, n in CASES:
            layout = plan_pipeline(
                cfg.n_layers, 2, PipelineConfig(schedule, stages_per_rank), n_microbatches=n
            )
            modules = [build_stage(cfg, spec) for spec in layout.stages_of_rank(ctx.coordinate("pp"))]
            pipe = Pipeline(
                layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=n, loss_fn=loss_fn
            )
            calls: list[tuple[int, int, bool]] = []

            def context(stage: int, microbatch: int, probe: bool) -> contextlib.AbstractContextManager[None]:
                calls.append((stage, microbatch, probe))  # noqa: B023  (this case's list)
                return contextlib.nullcontext()

            assert pipe.around_stage_forwards(context)
            seen[schedule] = []
            for step in range(2):
                micro = list(tokens[step].chunk(n))
                pipe.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro],
                          kwargs=[{"positions": positions}] * n)  # fmt: skip
                seen[schedule].append(list(calls))
                calls.clear()
    return seen


def test_a_torch_without_the_stage_hook_is_told_apart():
    class Stage:  # a stage of a torch without `register_forward_context`
        pass

    assert around_stage_forward(Stage(), lambda *_: contextlib.nullcontext()) is False  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list[list[tuple[int, int, bool]]]]]:
    return run_distributed(_forwards, 2, timeout=300)


@pytest.mark.skipif(not HOOKED, reason="this torch has no PipelineStage.register_forward_context")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_stage_forward_of_each_microbatch_runs_in_the_context_once_a_step_2ranks(ranks, case):
    schedule, stages_per_rank, n = case
    layout = plan_pipeline(
        TinyConfig().n_layers, 2, PipelineConfig(schedule, stages_per_rank), n_microbatches=n
    )
    for pp_rank, rank in enumerate(ranks):
        stages = [spec.index for spec in layout.stages_of_rank(pp_rank)]
        for step, calls in enumerate(rank[schedule]):
            real = sorted((s, m) for s, m, probe in calls if not probe)
            assert real == sorted((s, m) for s in stages for m in range(n)), (pp_rank, step, calls)
            probes = [s for s, _, probe in calls if probe]
            assert len(probes) == len(set(probes)) and set(probes) <= set(stages)
            if step == 1:
                assert not probes  # the probe belongs to the first step only
