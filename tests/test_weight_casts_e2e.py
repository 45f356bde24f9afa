"""bf16 compute without FSDP mixed precision casts each float32 weight once per optimizer step.

The quickstart through `Trainer` in bfloat16 on CPU (`_quickstart.train_counting_casts`); a dispatch
mode (`_dispatch.ParamCasts`) counts the copies that change a parameter's dtype. Before, autocast and
the model's own casts (norm scales, the MoE bank) cast every weight in each microbatch's forward and
again in each activation-checkpoint recompute (one process, 4 microbatches, full AC: 184 casts a
step for 24 weights; DDP 2: 25 per microbatch). Now each weight is cast once a step
(`d9d.parallel.weights_cast_once` in the step; FSDP2's replicate keeps its unsharded copy between
microbatches), and the runs are bit-identical to the path before (`today=True`).
"""

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, MOE, TINY, run_forked, train_counting_casts

from d9d.mesh.testing import run_distributed
from d9d.trainer import load_job_config
from d9d.trainer.planning import plan_config

STEPS = 2
RUN = [f"trainer.schedule.total_steps={STEPS}"]


def _assert_identical(today: dict[str, Any], now: dict[str, Any]) -> None:
    assert now["records"] == today["records"]
    assert now["weights"].keys() == today["weights"].keys()
    assert all(torch.equal(now["weights"][n], w) for n, w in today["weights"].items())


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_each_weight_is_cast_once_per_step_on_one_process(microbatches, ac, tmp_path):
    sets = [*RUN, f"data.global_batch_size={2 * microbatches}", f"trainer.activation_checkpointing.mode={ac}"]
    run = run_forked(train_counting_casts, str(tmp_path), sets)
    assert run["counts"] == dict.fromkeys(run["params"], STEPS)  # every weight but the embedding table


def test_the_moe_bank_and_the_recompute_cast_once_and_change_no_number(tmp_path):
    sets = [*RUN, "data.global_batch_size=8", "trainer.activation_checkpointing.mode=full", *MOE]
    today = run_forked(train_counting_casts, str(tmp_path / "today"), sets, True)
    now = run_forked(train_counting_casts, str(tmp_path / "now"), sets)
    # before: each microbatch's forward, and in the blocks its recompute
    assert today["counts"]["model.layers.0.mlp.experts.w_gate"] == STEPS * 4 * 2
    assert today["counts"]["lm_head.weight"] == STEPS * 4
    assert "model.layers.0.mlp.experts.w_gate" in now["params"]
    assert now["counts"] == dict.fromkeys(now["params"], STEPS)
    _assert_identical(today, now)


@pytest.mark.parametrize(
    "mesh",
    [["mesh.data_parallel_replicate=2", "data.global_batch_size=16"],
     ["mesh.tensor_parallel=2", "data.global_batch_size=8", "trainer.activation_checkpointing.mode=full"],
     ["mesh.pipeline_parallel=2", "data.global_batch_size=8"]],
    ids=["ddp2", "tp2", "pp2"],
)  # fmt: skip
def test_each_weight_is_cast_once_per_step_on_two_ranks_and_no_number_changes(mesh, tmp_path):
    sets = [*RUN, *mesh]
    today = run_distributed(train_counting_casts, 2, str(tmp_path / "today"), sets, True, timeout=180)
    now = run_distributed(train_counting_casts, 2, str(tmp_path / "now"), sets, timeout=180)
    for rank_today, rank_now in zip(today, now, strict=True):
        assert min(rank_today["counts"].values()) >= STEPS * 4  # before: at least once per microbatch
        assert rank_now["counts"] == dict.fromkeys(rank_now["params"], STEPS)
        _assert_identical(rank_today, rank_now)


def _planned_copies(sets: list[str]) -> int:
    loaded = load_job_config(CONFIG, [*TINY, "trainer.precision.param_dtype=bfloat16", *sets])
    plan = plan_config(loaded, device="cpu")
    assert plan.memory is not None
    return plan.memory.weight_copies


@pytest.mark.parametrize("mesh", [[], ["mesh.data_parallel_replicate=2", "data.global_batch_size=8"]],
                         ids=["one", "ddp2"])  # fmt: skip
def test_the_plan_counts_the_copies_a_step_keeps(mesh, tmp_path):
    sets = ["trainer.schedule.total_steps=1", *mesh]
    planned = run_forked(_planned_copies, sets)
    if mesh:
        runs = run_distributed(train_counting_casts, 2, str(tmp_path), sets, timeout=180)
    else:
        runs = [run_forked(train_counting_casts, str(tmp_path), sets)]
    assert planned > 0
    assert all(run["bytes"] == planned for run in runs)  # one step: the bytes its copies hold
