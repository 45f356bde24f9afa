"""MoE balancing through the trainer: the MoE quickstart with the auxiliary loss, the router z-loss and
the auxiliary-loss-free score bias records its expert load every step, and a run that crashes after a
checkpoint resumes to the uninterrupted one bit for bit (the score bias is checkpointed state). The
auxiliary loss and the z-loss weigh the same on data- and context-parallel ranks as on one process,
expert-parallel or not (their statistics over the ranks whose gradients the step sums)."""

from pathlib import Path

import pytest
import torch
from _quickstart import (
    MOE,
    NO_CLIP,
    SGD,
    RunResult,
    compare_runs,
    overrides,
    records,
    run_forked,
    train,
    train_and_gather,
)

BALANCED = [
    "model.moe={num_experts: 4, top_k: 2, moe_intermediate_size: 64, "
    "balancing: {aux_loss_coef: 0.01, z_loss_coef: 0.001, bias_update_rate: 0.01}}"
]
STEPS = 8


def test_a_balanced_moe_run_records_its_load_and_resumes_bit_exact_after_a_crash(tmp_path):
    assert MOE[0].startswith("model.moe=")  # BALANCED is the e2e tests' MoE with balancing on
    full = train(1, overrides(tmp_path, "full", STEPS, *BALANCED, "trainer.checkpointing.period_steps=4"))
    for record in full.records:
        assert 0 <= record["moe_load_min"] <= 1 <= record["moe_load_max"] and record["moe_load_cv"] >= 0
    crashed = overrides(tmp_path, "crashed", STEPS, *BALANCED, "trainer.checkpointing.period_steps=4")
    with pytest.raises(AssertionError, match="injected"):
        run_forked(train_and_gather, crashed, env={"D9D_TEST_RAISE_AT_STEP": "6"})
    assert (tmp_path / "crashed" / "save-4").exists() and not (tmp_path / "crashed" / "save-8").exists()
    resumed = train(1, crashed)
    compare_runs(resumed, full, rel=0)  # losses, grad norms, lr and weights: the same bits
    assert [r["moe_load_cv"] for r in records(tmp_path / "crashed")] == [
        r["moe_load_cv"] for r in full.records
    ]
    biases = {k: v for k, v in resumed.weights.items() if k.endswith("router.score_bias")}
    assert len(biases) == 2 and all(torch.equal(v, full.weights[k]) for k, v in biases.items())
    assert any(bool(v.abs().sum() > 0) for v in biases.values())  # the bias did move


#: Strong balancing terms (the e2e's are 0.01 and 0.001), so a wrong weight of them moves every number.
STRONG = [
    "model.moe={num_experts: 4, top_k: 2, moe_intermediate_size: 64, "
    "balancing: {aux_loss_coef: 1.0, z_loss_coef: 0.1}}"
]
#: One microbatch per data-parallel rank, so each step's auxiliary loss is the global batch's, as one
#: process with the whole batch in one microbatch computes it (d9d.parallel.expert.balancing).
MESHES = {
    "fsdp2": ["mesh.data_parallel_shard=2", "data.microbatch_size=8"],
    "cp2": ["mesh.context_parallel=2", "data.microbatch_size=16"],
}


def _strong(save_dir: Path, name: str, *extra: str) -> list[str]:
    return overrides(
        save_dir, name, 3, *STRONG, *SGD, *NO_CLIP, "trainer.checkpointing.period_steps=0", *extra
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return train(1, _strong(tmp_path_factory.mktemp("moe-one"), "one", "data.microbatch_size=16"))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_balancing_losses_on_data_or_context_parallel_ranks_equal_one_process(tmp_path, one_process, mesh):
    run = train(2, _strong(tmp_path, mesh, *MESHES[mesh]))
    compare_runs(run, one_process, rel=1e-5)
