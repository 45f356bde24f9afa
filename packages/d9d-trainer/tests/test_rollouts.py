"""Rollouts (`d9d.trainer.rollouts`): the log-probabilities sampling returns are the training forward's
on the same tokens (a fused head's per-token losses at the sampling temperature), in float32 within
1e-5 and, under bfloat16 autocast, within the gap measured here; a prompt's completions depend on its
generator only; the KV cache and the whole-sequence path sample the same tokens."""

import pytest
import torch

from d9d.data import IGNORE_INDEX
from d9d.parallel import fuse_linear_cross_entropy, set_head_reduction
from d9d.trainer.builtins.grpo import group_advantages
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig
from d9d.trainer.rollouts import rollout_batch, sample_group

CONFIG = ReferenceModelConfig(vocab_size=53, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _model(temperature: float) -> ReferenceForCausalLM:
    torch.manual_seed(0)
    model = ReferenceForCausalLM(CONFIG)
    model.lm_head = fuse_linear_cross_entropy(model.lm_head, chunk_size=7)
    set_head_reduction(model, "none", temperature=temperature)
    return model.eval()


def _rollouts(model, temperature, seed=0, prompts=((3, 9, 14, 2), (5, 1, 7)), top_p=None):
    groups, ids = [], [torch.tensor(p) for p in prompts]
    for i, prompt in enumerate(ids):
        groups.append(sample_group(model, prompt, 4, max_new_tokens=6, temperature=temperature, top_p=top_p,
                                   stop_ids=(0,), generator=torch.Generator().manual_seed(seed + i)))  # fmt: skip
    rewards = torch.arange(8, dtype=torch.float64) % 3
    return ids, groups, rollout_batch(ids, groups, group_advantages(rewards, 4, True), rewards)


def _training_logps(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return -model(batch["input_ids"], labels=batch["labels"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_training_forwards_in_float32(temperature):
    model = _model(temperature)
    _, groups, batch = _rollouts(model, temperature)
    mask = batch["labels"] != IGNORE_INDEX
    assert int(mask.sum()) == int(sum(g.lengths.sum() for g in groups))  # every sampled token labelled
    forward = _training_logps(model, batch)
    gap = float((forward - batch["old_logps"])[mask].abs().max())
    assert gap <= 1e-5, gap  # measured 4.8e-7 (temperature 1), the ratio is 1 at the first step
    assert bool((batch["old_logps"][~mask] == 0).all())


def test_bfloat16_gap_between_sampling_and_training_log_probs_is_small():
    """Under bfloat16 autocast both run in bfloat16 (the cache's keys and values too): the gap is the
    kernels' rounding: measured here (CPU) 4.8e-7 nats at most; the test allows 0.05."""
    model = _model(1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, batch = _rollouts(model, 1.0)
        forward = _training_logps(model, batch)
    mask = batch["labels"] != IGNORE_INDEX
    gap = float((forward.float() - batch["old_logps"])[mask].abs().max())
    assert gap < 0.05, gap  # measured on CPU: 4.8e-7 (the same bfloat16 kernels; GPU ones differ more)


def test_completions_depend_on_the_prompt_generator_and_the_cache_does_not_change_them():
    model = _model(1.0)
    _, first, _ = _rollouts(model, 1.0, seed=3)
    _, again, _ = _rollouts(model, 1.0, seed=3)
    _, other, _ = _rollouts(model, 1.0, seed=4)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, again, strict=True))
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(first, other, strict=True))
    # the same prompt without the KV cache (the whole sequence each token): the same tokens
    uncached = model.__class__.__new__(model.__class__)
    uncached.__dict__ = dict(model.__dict__)
    uncached.new_kv_cache = None  # method_of: no cache
    _, plain, _ = _rollouts(uncached, 1.0, seed=3)
    for a, b in zip(first, plain, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logps, b.logps, rtol=0, atol=1e-5)


def test_group_advantages_center_and_scale_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    scaled = group_advantages(rewards, 4, True)
    assert torch.allclose(scaled[:4].double().mean(), torch.zeros((), dtype=torch.float64), atol=1e-7)
    assert torch.allclose(scaled[:4].double().std(), torch.ones((), dtype=torch.float64), atol=1e-3)
    assert bool((scaled[4:] == 0).all())  # equal rewards: no signal
    assert torch.equal(group_advantages(rewards, 4, False)[:4], (rewards[:4] - 0.5).float())
