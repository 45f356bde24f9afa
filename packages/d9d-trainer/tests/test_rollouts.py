"""Rollouts (`d9d.trainer.rollouts`): the log-probabilities sampling returns are the training forward's
on the same tokens (a fused head's per-token losses at the sampling temperature), in float32 within
1e-5 and, under bfloat16 autocast, within the gap measured here; a prompt's completions depend on its
generator only; the KV cache and the whole-sequence path sample the same tokens. On an MoE model the
experts sampling chose are recorded per row and position, and GRPO's training forward with
`rl.replay_routing` routes every token to them (with its log-probs sampling's) where the moved routers
alone would not."""

from types import SimpleNamespace

import msgspec
import pytest
import torch

from d9d.data import IGNORE_INDEX
from d9d.parallel import fuse_linear_cross_entropy, set_head_reduction
from d9d.parallel.expert import moe_layers, record_routing, set_replayed_routing
from d9d.trainer import GRPOConfig, GRPOTask, TrainingError
from d9d.trainer.builtins.grpo import group_advantages
from d9d.trainer.models import MoEConfig, ReferenceForCausalLM, ReferenceModelConfig
from d9d.trainer.providers import LossContext, PrepareRunContext
from d9d.trainer.rollouts import rollout_batch, sample_group, sample_groups

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


# ------------------------------------------------------------------ MoE routing, recorded and replayed

MOE_CONFIG = msgspec.structs.replace(CONFIG, moe=MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32))


def _moe_model() -> ReferenceForCausalLM:
    torch.manual_seed(0)
    model = ReferenceForCausalLM(MOE_CONFIG)
    model.lm_head = fuse_linear_cross_entropy(model.lm_head, chunk_size=7)
    set_head_reduction(model, "none", temperature=1.0)
    return model.eval()


def _moe_rollouts(model):
    groups, ids = [], [torch.tensor(p) for p in ((3, 9, 14, 2), (5, 1, 7))]
    for i, prompt in enumerate(ids):
        groups.append(sample_groups(model, [prompt], 4, max_new_tokens=6, temperature=1.0, top_p=None,
                                    stop_ids=(0,), generators=[torch.Generator().manual_seed(i)], routing=True)[0])  # fmt: skip
    rewards = torch.arange(8, dtype=torch.float64) % 3
    return ids, groups, rollout_batch(ids, groups, group_advantages(rewards, 4, True), rewards)


def _training_forward(model, batch, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's token log-probs and the experts it chose, [rows, width, layers, top_k]."""
    routing = batch["routing"].unbind(2) if replay else None
    with torch.no_grad(), record_routing(model) as chosen:
        set_replayed_routing(model, routing)
        logps = -model(batch["input_ids"], labels=batch["labels"])
        set_replayed_routing(model, None)
    rows, width = batch["input_ids"].shape
    return logps, torch.stack([f[0].view(rows, width, -1) for f in chosen], dim=2)


def _mismatches(batch, chosen) -> int:
    """Tokens whose experts differ from the recorded ones, over the positions sampling fed."""
    recorded = batch["routing"][..., 0] >= 0
    return int((chosen != batch["routing"]).any(-1)[recorded].sum())


def test_sampling_records_every_fed_positions_experts_and_replay_picks_exactly_them():
    model = _moe_model()
    _, _, batch = _moe_rollouts(model)
    layers = len(moe_layers(model))
    assert (
        batch["routing"].shape == (*batch["input_ids"].shape, layers, 2) and layers == MOE_CONFIG.num_layers
    )
    labelled = batch["labels"] != IGNORE_INDEX
    # every position a label's log-prob is computed at (and every prompt position) was fed and recorded
    assert bool((batch["routing"][..., 0] >= 0)[labelled].all())
    assert bool((batch["routing"][:, :3, :, 0] >= 0).all())
    for replay in (True, False):  # the same weights: the router chooses the same experts either way
        logps, chosen = _training_forward(model, batch, replay)
        assert _mismatches(batch, chosen) == 0
        gap = float((logps - batch["old_logps"])[labelled].abs().max())
        assert gap <= 1e-5, gap  # measured 4.8e-7: the replayed forward's log-probs are sampling's


def test_after_an_update_only_the_replayed_forward_keeps_samplings_experts():
    model = _moe_model()
    _, _, batch = _moe_rollouts(model)
    with (
        torch.no_grad()
    ):  # the routers move a little between sampling and training (a tenth of their init std)
        for layer in moe_layers(model):
            layer.router.gate.weight.add_(torch.randn_like(layer.router.gate.weight), alpha=0.002)
    _, own = _training_forward(model, batch, replay=False)
    _, replayed = _training_forward(model, batch, replay=True)
    assert _mismatches(batch, own) > 0  # measured: 21 of the 128 (token, layer) choices move
    assert _mismatches(batch, replayed) == 0


def test_the_whole_sequence_path_records_the_same_routing_as_the_cache():
    model = _moe_model()
    _, cached, _ = _moe_rollouts(model)
    uncached = model.__class__.__new__(model.__class__)
    uncached.__dict__ = dict(model.__dict__)
    uncached.new_kv_cache = None  # method_of: no cache
    _, plain, _ = _moe_rollouts(uncached)
    for a, b in zip(cached, plain, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routing, b.routing)


@pytest.mark.parametrize("replay", [True, False])
def test_grpo_training_forward_replays_the_rollouts_routing_only_when_asked(tmp_path, replay):
    """`GRPOTask.compute_loss` with `rl.replay_routing` routes every recorded token to sampling's
    experts on moved routers, and keeps them set for the backward (the step clears them)."""
    (tmp_path / "rewards.py").write_text(
        "def reward(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    task = GRPOTask(GRPOConfig(reward=f"{tmp_path / 'rewards.py'}:reward", replay_routing=replay))
    model = _moe_model()
    _, _, batch = _moe_rollouts(model)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.gate.weight.add_(torch.randn_like(layer.router.gate.weight), alpha=0.002)
    model.train()
    with record_routing(model) as chosen:
        result = task.compute_loss(LossContext(model=model, batch=batch, device=torch.device("cpu")))
    rows, width = batch["input_ids"].shape
    mismatches = _mismatches(batch, torch.stack([f[0].view(rows, width, -1) for f in chosen], dim=2))
    assert (mismatches == 0) if replay else (mismatches > 0)
    assert (moe_layers(model)[0].router.replay is not None) == replay  # still set for the backward
    result.loss_sum.backward()
    set_replayed_routing(model, None)
    if replay:  # a checkpoint keeps the rollouts' routing (a resume mid-generation replays it)
        resumed = GRPOTask(task.config)
        task._rollouts = [batch]
        resumed.load_state_dict(task.state_dict())
        assert torch.equal(resumed._rollouts[0]["routing"], batch["routing"])


def test_grpo_refuses_routing_replay_without_moe_layers_in_one_line(tmp_path):
    (tmp_path / "rewards.py").write_text(
        "def reward(prompts, completions, **_):\n    return [0.0] * len(completions)\n"
    )
    task = GRPOTask(GRPOConfig(reward=f"{tmp_path / 'rewards.py'}:reward", replay_routing=True))
    prompts = SimpleNamespace(record=lambda index: {}, tokenizer=None)
    context = PrepareRunContext(run_dir=tmp_path, model=_model(1.0), context=None, datasets={"train": prompts},
                                restored=False, forward_only=lambda role: None)  # fmt: skip
    with pytest.raises(TrainingError, match=r"rl\.replay_routing .* the model has none") as caught:
        task.prepare_run(context)
    assert "\n" not in str(caught.value)
