"""MoE balancing through the trainer: the MoE quickstart with the auxiliary loss, the router z-loss and
the auxiliary-loss-free score bias records its expert load every step, and a run that crashes after a
checkpoint resumes to the uninterrupted one bit for bit (the score bias is checkpointed state)."""

import pytest
import torch
from _quickstart import MOE, compare_runs, overrides, records, run_forked, train, train_and_gather

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
