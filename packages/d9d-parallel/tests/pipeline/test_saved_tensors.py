"""Nothing a pipeline step saves for backward outlives the step, on any stage of any schedule.

Two forked ranks over gloo run 2 steps of every schedule under `SavedTensors` (see its module for
why the count keeps tensors detached); after each step, with a full garbage collection, the bytes
still saved for backward must be 0 on both ranks. Step 1 includes torch's metadata inference (on
torch 2.15 a real forward, and on stage 0 no backward over it, as its inputs are token ids): that
graph is freed too. Measured on torch 2.15: 0 bytes after every step of every case; a stage-0
forward kept without backward, the control, is seen (~90 KB) and gone once dropped.
"""

import pytest
import torch
from _pipeline_model import SCHEDULE_CASES, SEQ, TinyConfig, batches, build_stage, loss_fn
from _saved_tensors import SavedTensors

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import Pipeline, PipelineConfig, plan_pipeline

STEPS = 2  # the first (with torch's metadata inference) and a steady one
CASES = SCHEDULE_CASES


def _saved_after_steps() -> dict[str, object]:
    cfg = TinyConfig()
    tokens = batches(cfg)
    positions = torch.arange(SEQ)
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=2)) as ctx:
        pp_rank = ctx.coordinate("pp")
        saved = SavedTensors()
        # the control: a forward whose graph is kept is counted, and released when it is dropped
        stage_0 = build_stage(cfg, plan_pipeline(cfg.n_layers, 2, PipelineConfig("1f1b")).stages[0])
        with saved.recording():
            kept = stage_0(tokens[0, :2, :-1], positions)
        control = (saved.alive()[1], None)
        del kept
        control = (control[0], saved.alive()[1])

        after: dict[str, list[int]] = {}
        packed: dict[str, int] = {}
        for schedule, stages_per_rank, n in CASES:
            layout = plan_pipeline(
                cfg.n_layers, 2, PipelineConfig(schedule, stages_per_rank), n_microbatches=n
            )
            modules = [build_stage(cfg, spec) for spec in layout.stages_of_rank(pp_rank)]
            pipe = Pipeline(
                layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=n, loss_fn=loss_fn
            )
            optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.5)
            name = f"{schedule} x{stages_per_rank} mb{n}"
            before = saved.packed_bytes
            after[name] = []
            for step in range(STEPS):
                micro = list(tokens[step].chunk(n))
                with saved.recording():
                    pipe.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro],
                              kwargs=[{"positions": positions}] * n)  # fmt: skip
                after[name].append(saved.alive()[1])  # between steps: after the step, before the next
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            packed[name] = saved.packed_bytes - before
        return {"control": control, "after": after, "packed": packed}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_distributed(_saved_after_steps, 2, timeout=300)


def test_the_count_sees_a_kept_graph_and_its_release_2ranks(ranks):
    for rank in ranks:
        held, released = rank["control"]
        assert held > 0 and released == 0, rank["control"]


@pytest.mark.parametrize("case", [f"{s} x{k} mb{n}" for s, k, n in CASES])
def test_no_saved_tensor_outlives_a_pipeline_step_on_any_stage_2ranks(ranks, case):
    for pp_rank, rank in enumerate(ranks):
        assert rank["packed"][case] > 0, f"rank {pp_rank}: the hooks saw nothing of {case}"
        assert rank["after"][case] == [0] * STEPS, (
            f"rank {pp_rank} ({case}): bytes still saved for backward after each step: {rank['after'][case]}"
        )
