"""Nothing a pipeline step makes outlives the step, on any stage of any schedule.

Two forked ranks over gloo run 2 steps of every schedule, counted two independent ways after each
step, with a full garbage collection: the bytes still saved for backward (`SavedTensors`, whose hooks
keep tensors detached: see its module) and, with no autograd hook at all, every storage the step made
that anyone still holds (`d9d.mesh.testing.StorageCensus`: saved activations, receive buffers, cached
outputs), but the parameters and their gradients. Both must be 0 on both ranks. Step 1 includes
torch's metadata inference (on torch 2.15 a real forward, and on stage 0 no backward over it, as its
inputs are token ids): that graph is freed too. Measured: 0 bytes after every step of every case by
both counts, on torch 2.15 and 2.11; before `Pipeline.step` freed them, the census found on 2.11 the
receive buffers torch keeps (one per microbatch and direction: 4,096 B per rank for 1f1b with 2
microbatches of 4 × 8 × 16 floats, 12,288 B for interleaved 1f1b). A stage-0 forward kept without
backward, the control, is seen by both counts (~50 KB saved) and gone once dropped.
"""

import pytest
import torch
from _alive_storages import StorageCensus
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
        census = StorageCensus()
        with saved.recording(), census:
            kept = stage_0(tokens[0, :2, :-1], positions)
        held = (saved.alive()[1], census.alive(stage_0.parameters())[0])
        del kept
        control = {
            "held": held,
            "released": (saved.alive()[1], census.alive(stage_0.parameters())[0]),
        }

        after: dict[str, list[int]] = {}
        alive: dict[str, list[tuple[int, list[str]]]] = {}
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
            after[name], alive[name] = [], []
            for step in range(STEPS):
                micro = list(tokens[step].chunk(n))
                census = StorageCensus()
                with saved.recording(), census:
                    pipe.step([m[:, :-1] for m in micro], [m[:, 1:] for m in micro],
                              kwargs=[{"positions": positions}] * n)  # fmt: skip
                after[name].append(saved.alive()[1])  # between steps: after the step, before the next
                params = [p for m in modules for p in m.parameters()]
                assert census.seen > 0, "the census saw nothing of the step"
                alive[name].append(census.alive([*params, *(p.grad for p in params)]))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            packed[name] = saved.packed_bytes - before
        return {"control": control, "after": after, "alive": alive, "packed": packed}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_distributed(_saved_after_steps, 2, timeout=300)


def test_both_counts_see_a_kept_graph_and_its_release_2ranks(ranks):
    for rank in ranks:
        (saved, alive), released = rank["control"]["held"], rank["control"]["released"]
        assert saved > 0 and alive > 0 and released == (0, 0), rank["control"]


@pytest.mark.parametrize("case", [f"{s} x{k} mb{n}" for s, k, n in CASES])
def test_no_saved_tensor_outlives_a_pipeline_step_on_any_stage_2ranks(ranks, case):
    for pp_rank, rank in enumerate(ranks):
        assert rank["packed"][case] > 0, f"rank {pp_rank}: the hooks saw nothing of {case}"
        assert rank["after"][case] == [0] * STEPS, (
            f"rank {pp_rank} ({case}): bytes still saved for backward after each step: {rank['after'][case]}"
        )
        assert [size for size, _ in rank["alive"][case]] == [0] * STEPS, (
            f"rank {pp_rank} ({case}): storages of the step still alive after it: {rank['alive'][case]}"
        )
