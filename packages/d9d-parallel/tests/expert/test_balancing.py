"""MoE balancing: the score bias chooses experts (not their weights) and evens a skewed router's load;
the z-loss and the regularization sum; a step's load summary."""

import pytest
import torch

from d9d.parallel.expert import (
    MoE,
    MoEBalancing,
    TopKRouter,
    expert_load_summary,
    expert_loads,
    moe_layers,
    moe_regularization_loss,
    moe_score_bias_names,
    update_expert_biases,
)

HIDDEN, FFN, EXPERTS = 32, 48, 8


def test_the_score_bias_chooses_the_experts_and_the_weights_stay_the_probabilities():
    torch.manual_seed(0)
    router = TopKRouter(HIDDEN, EXPERTS, 2, renormalize=False, score_bias=True)
    x = torch.randn(16, HIDDEN)
    plain = router(x)
    router.score_bias[3] = 10.0  # expert 3 wins every token's first slot
    biased = router(x)
    assert (biased.indices[:, 0] == 3).all()
    torch.testing.assert_close(biased.weights, biased.probs.gather(-1, biased.indices))
    torch.testing.assert_close(biased.probs, plain.probs)  # the bias changes no probability
    assert "score_bias" in router.state_dict()  # model state: checkpointed
    assert "score_bias" not in TopKRouter(HIDDEN, EXPERTS, 2).state_dict()  # off: no new key


def test_the_bias_update_evens_out_a_skewed_router():
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, EXPERTS, 2, balancing=MoEBalancing(bias_update_rate=0.01))
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.2  # with inputs of a positive mean: expert 0 is everyone's favourite
    x = torch.randn(512, HIDDEN) + 0.5
    layers = moe_layers(torch.nn.Sequential(moe))
    cvs = []
    for _ in range(60):
        moe(x)
        loads = expert_loads(layers)
        assert loads is not None
        cvs.append(float(expert_load_summary(loads)[2]))
        update_expert_biases(layers, loads)
    assert cvs[0] > 1.0 and max(cvs[-10:]) < cvs[0] / 2, cvs[::6]  # the load moved toward uniform


def test_z_loss_and_the_regularization_sum():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        MoE(HIDDEN, FFN, EXPERTS, 2, balancing=MoEBalancing(aux_loss_coef=0.1, z_loss_coef=0.01))
    )
    layers = moe_layers(model)
    x = torch.randn(4, 5, HIDDEN)
    model(x)
    stats = layers[0].last_stats
    assert stats is not None
    logits = layers[0].router.gate(x.reshape(-1, HIDDEN)).float()
    torch.testing.assert_close(stats.z_loss, torch.logsumexp(logits, -1).square().mean())
    torch.testing.assert_close(moe_regularization_loss(layers), 0.1 * stats.aux_loss + 0.01 * stats.z_loss)
    assert moe_regularization_loss(moe_layers(torch.nn.Sequential(MoE(HIDDEN, FFN, EXPERTS, 2)))) is None
    assert moe_score_bias_names(model) == []
    biased = torch.nn.Sequential(MoE(HIDDEN, FFN, EXPERTS, 2, balancing=MoEBalancing(bias_update_rate=0.1)))
    assert moe_score_bias_names(biased) == ["0.router.score_bias"]


def test_the_load_summary_takes_the_worst_layer():
    loads = torch.tensor([[10.0, 10.0, 10.0, 10.0], [0.0, 20.0, 10.0, 10.0]])
    low, high, cv = expert_load_summary(loads).tolist()
    assert (low, high) == (0.0, 2.0) and cv == pytest.approx(
        torch.tensor([0.0, 20.0, 10.0, 10.0]).std(correction=0).item() / 10
    )


def test_negative_coefficients_are_refused():
    with pytest.raises(ValueError, match="bias_update_rate must be >= 0"):
        MoEBalancing(bias_update_rate=-1)
