"""Training's random streams on real ranks (forked gloo processes), the quickstart with LoRA dropout:
data-parallel ranks draw different masks, tensor-parallel peers the same ones, together the masks of
one process; pipeline stages their own per microbatch; the data each step loads in the training
process draws per data-parallel rank; a run repeats and resumes bit for bit (docs/checkpointing.md,
"Randomness")."""

import random
import signal
from typing import Any

import numpy as np
import pytest
import torch
from _quickstart import CONFIG, NO_CLIP, SGD, RunResult, compare_runs, overrides, run_forked, train
from faults._harness import committed_steps, preload_distributed, start_ranks, wait_for
from torch import nn

from d9d.mesh.testing import run_distributed
from d9d.trainer import CausalLMTask, Trainer
from d9d.trainer.providers import PrepareStepContext

pytestmark = pytest.mark.slow

#: Adapters on q_proj and v_proj of both layers: 4 dropout calls per microbatch. Column-wise under
#: tensor parallelism, so their input (what the dropout masks) is the same tensor on both TP ranks.
LORA = r"peft.lora={rank: 4, alpha: 8, dropout: 0.3, target_modules: ['.*\.(q_proj|v_proj)']}"
CALLS = 4
#: 4 microbatches per step (global batch 8, microbatch 2): 2 per rank on 2 data-parallel ranks.
BATCH = ["data.global_batch_size=8", "data.microbatch_size=2"]
STEPS = 2

#: What `RecordingTask.prepare_step` drew in this process: (step, torch, numpy, Python).
Draw = tuple[int, float, float, float]
DRAWS: list[Draw] = []


class RecordingTask(CausalLMTask):
    """The quickstart's task; records one draw of each global generator when a step's data is made."""

    def prepare_step(self, context: PrepareStepContext) -> Any:
        DRAWS.append((context.step, float(torch.rand(())), float(np.random.rand()), random.random()))
        return next(context.data)


def _masks(args: list[str]) -> tuple[dict[str, int], list[torch.Tensor], list[Draw]]:
    """Train; this rank's coordinates, every dropout mask in call order and the data draws."""
    masks: list[torch.Tensor] = []

    def record(module: nn.Module, inputs: Any, out: torch.Tensor) -> None:
        local = out.to_local() if hasattr(out, "to_local") else out
        masks.append((local == 0).detach().clone())

    with Trainer.from_config(CONFIG, [*args, f"providers.task={__name__}:RecordingTask"]) as trainer:
        for module in trainer.model.modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(record)
        trainer.train()
        ctx = trainer.context
        coords = {axis: ctx.coordinate(axis) for axis in ("dp", "tp", "pp")}
    return coords, masks, list(DRAWS)


def _one_process(tmp_path: Any) -> tuple[list[torch.Tensor], list[Draw]]:
    _, masks, draws = run_forked(_masks, overrides(tmp_path, "one", STEPS, LORA, *BATCH))
    return masks, draws


def _per_step(masks: list[torch.Tensor], per_step: int) -> list[list[torch.Tensor]]:
    assert len(masks) == STEPS * per_step
    return [masks[s * per_step : (s + 1) * per_step] for s in range(STEPS)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_data_parallel_ranks_draw_the_one_process_masks_between_them_tp_peers_alike_world_4(tmp_path):
    preload_distributed()
    one_masks, one_draws = _one_process(tmp_path)
    mesh = ["mesh.data_parallel_shard=2", "mesh.tensor_parallel=2"]
    ranks = run_distributed(_masks, 4, overrides(tmp_path, "dp2tp2", STEPS, LORA, *BATCH, *mesh), timeout=120)
    by = {(c["dp"], c["tp"]): (m, d) for c, m, d in ranks}
    for dp in (0, 1):  # tensor-parallel peers: the same masks, the same data draws
        assert _same(by[dp, 0][0], by[dp, 1][0]) and by[dp, 0][1] == by[dp, 1][1]
    dp0, dp1 = by[0, 0], by[1, 0]
    assert not any(torch.equal(a, b) for a, b in zip(dp0[0], dp1[0], strict=True))  # DP ranks differ
    assert all(a[1:] != b[1:] for a, b in zip(dp0[1], dp1[1], strict=True))  # torch, numpy, Python
    # together they are one process's masks: microbatches 0, 1 on dp 0 and 2, 3 on dp 1, every step
    one = _per_step(one_masks, 4 * CALLS)
    split = [_per_step(m, 2 * CALLS) for m in (dp0[0], dp1[0])]
    for step in range(STEPS):
        assert _same(split[0][step] + split[1][step], one[step]), f"step {step + 1}"
    assert dp0[1] == one_draws and [d[0] for d in one_draws] == [1, 2]


def test_pipeline_stages_draw_per_microbatch_and_stage_the_first_one_process_masks_world_4(tmp_path):
    preload_distributed()
    one_masks, _ = _one_process(tmp_path)
    mesh = ["mesh.data_parallel_shard=2", "mesh.pipeline_parallel=2"]
    ranks = run_distributed(_masks, 4, overrides(tmp_path, "pp2dp2", STEPS, LORA, *BATCH, *mesh), timeout=120)
    per_stage = CALLS // 2  # a layer per stage: its q_proj and v_proj
    by = {}
    for coords, masks, draws in ranks:
        probe = len(masks) - STEPS * 2 * per_stage  # torch's metadata-inference forward, first step
        assert probe in (0, per_stage), len(masks)
        by[coords["dp"], coords["pp"]] = (_per_step(masks[probe:], 2 * per_stage), draws)
    one = _per_step(one_masks, 4 * CALLS)
    for step in range(STEPS):
        for dp in (0, 1):
            for j in (0, 1):  # stage 0 runs layer 0: one process's masks of layer 0, microbatch 2 dp + j
                g = 2 * dp + j
                stage_0 = by[dp, 0][0][step][j * per_stage : (j + 1) * per_stage]
                assert _same(stage_0, one[step][g * CALLS : g * CALLS + per_stage]), (step, dp, j)
                stage_1 = by[dp, 1][0][step][j * per_stage : (j + 1) * per_stage]
                assert not _same(stage_1, one[step][g * CALLS + per_stage : (g + 1) * CALLS])
                assert not any(torch.equal(a, b) for a, b in zip(stage_0, stage_1, strict=True))
        assert not any(torch.equal(a, b) for a, b in zip(by[0, 1][0][step], by[1, 1][0][step], strict=True))
    # the data draws: per data-parallel rank, alike over the stages
    assert by[0, 0][1] == by[0, 1][1] and by[1, 0][1] == by[1, 1][1] and by[0, 0][1] != by[1, 0][1]


@pytest.mark.parametrize(
    ("mesh", "rel"),
    [
        ("mesh.data_parallel_shard=2", 1e-5),  # one process's masks: its numbers
        ("mesh.pipeline_parallel=2", None),  # stage 1 draws its own masks: other numbers
    ],
    ids=["dp2", "pp2"],
)
def test_dropout_on_two_ranks_repeats_and_resumes_bit_exact(tmp_path, mesh, rel):
    preload_distributed()
    steps = 6
    common = [LORA, *BATCH, *SGD, *NO_CLIP, "trainer.checkpointing.period_steps=2"]

    def run(name: str, *extra: str) -> list[str]:
        return overrides(tmp_path, name, steps, *extra, f"export.dir={tmp_path / (name + '-export')}")

    full = train(2, run("full", *common, mesh))
    if rel is not None:
        compare_runs(full, train(1, run("one", *common)), rel=rel)
    compare_runs(train(2, run("again", *common, mesh)), full, rel=0)
    killed = run("killed", *common, mesh)
    (tmp_path / "logs").mkdir()
    jobs = start_ranks(2, killed, tmp_path / "logs", env={"D9D_TEST_HANG_AT_STEP": "5"})
    wait_for(lambda: 4 in committed_steps(tmp_path / "killed"), jobs[0], timeout=120, what="save-4")
    for job in jobs:
        job.kill()
    assert [job.poll() for job in jobs] == [-signal.SIGKILL] * 2
    (tmp_path / "logs2").mkdir()
    resumed = start_ranks(2, killed, tmp_path / "logs2")
    assert [job.wait(120) for job in resumed] == [0, 0], resumed[0].output()[-3000:]
    assert "resumed" in resumed[0].output()
    compare_runs(RunResult.read(tmp_path / "killed", tmp_path / "killed-export"),
                 RunResult.read(tmp_path / "full", tmp_path / "full-export"), rel=0)  # fmt: skip
    # the dropout is live: without it the same run trains to other numbers
    no_dropout = train(2, run("no-dropout", *[a.replace("0.3", "0.0") for a in common], mesh))
    assert [r["loss"] for r in no_dropout.records][1:] != [r["loss"] for r in full.records][1:]
