"""Reinforcement learning with rollouts, colocated (`d9d.trainer:GRPOTask`, the job's `rl:` section).

    providers: {dataset: d9d.trainer:PromptDatasetProvider, task: d9d.trainer:GRPOTask}
    rl: {reward: rewards.py:exact_match, group_size: 8, max_new_tokens: 16}

Each generation step draws the step's prompts from the data provider (`PreparesSteps`), samples
`group_size` completions of each with the current weights on the rank that holds the prompt
(`d9d.trainer.rollouts`), scores them with the user's reward function, and turns the rewards into
group-relative advantages: (reward − the group's mean) / (the group's std + 1e-4). The step is the
clipped policy gradient, per completion token (TRL's default `dapo` normalization: the mean over the
global batch's completion tokens), with an optional KL penalty to the starting weights (with LoRA:
the base model, adapters off). `iterations` optimizer steps reuse one generation's rollouts (the
importance ratio then departs from 1; the rollouts are kept in the checkpoint). With `replay_routing`
on an MoE model, sampling records the experts every MoE layer chose for every token, and the training
forward routes each token to those experts (the weights from the current router), so a changed
router between sampling and training does not change which experts a token's log-prob comes from.

The reward function is named like a provider (`file.py:name`, relative to the config, or
`package.module:name`) and called as TRL calls one: `reward(prompts=[str], completions=[str],
**fields)` → one number per completion, where `fields` are the prompt lines' other JSONL fields, one
value per completion.
"""

import json
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from d9d.data import IGNORE_INDEX
from d9d.mesh import get_logger
from d9d.parallel import lora_disabled, lora_parameters, set_head_reduction
from d9d.parallel.expert import moe_layers, set_replayed_routing
from d9d.trainer.builtins.logprobs import token_logps
from d9d.trainer.config.base import ConfigImport
from d9d.trainer.errors import TrainingError
from d9d.trainer.job.resolve import resolve_object
from d9d.trainer.providers.task import (
    LossContext,
    LossResult,
    PrepareRunContext,
    PrepareStepContext,
    fused_loss_chunk_size,
    tensor_from_state,
    tensor_state,
)
from d9d.trainer.rollouts import Rollouts, rollout_batch, sample_groups

__all__ = ["GRPOConfig", "GRPOTask", "group_advantages"]

_log = get_logger("d9d.trainer")

#: The summed values each microbatch reports (`summarize_metrics` turns them into the logged ones).
_SUMS = ("reward_sum", "reward_sq_sum", "rollouts", "clipped_tokens", "kl_sum")


class GRPOConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `rl:` section.

    Attributes:
        reward: the reward function, `file.py:name` (relative to the config) or `package.module:name`.
        group_size: completions per prompt (G, at least 2: the advantages compare them).
        max_new_tokens: the most tokens a completion may have.
        temperature: sampling temperature (the log-probabilities are of this distribution, as TRL's).
        top_p: sample among the most likely tokens whose probabilities add up to p (1: all).
        stop_ids: token ids that end a completion (besides the tokenizer's end of document).
        epsilon: the ratio's lower clip, 1 − epsilon.
        epsilon_high: its upper clip, 1 + epsilon_high (null: epsilon).
        beta: the KL penalty to the starting weights (k3 estimator); needs LoRA (the reference is the
            base model with the adapters off). 0: none.
        iterations: optimizer steps per generation of rollouts.
        scale_rewards: "group" divides the advantages by the group's std, "none" does not (Dr. GRPO).
        seed: the sampling seed; a prompt's completions are drawn from (seed, step, prompt index).
        log_samples: completions written to RUN_DIR/rollouts/step-N.jsonl per generation (rank 0's).
        replay_routing: record the experts each MoE layer chose while sampling and use them in the
            training forward (an MoE model only: refused without MoE layers).
    """

    reward: ConfigImport
    group_size: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    iterations: int = 1
    scale_rewards: Literal["group", "none"] = "group"
    seed: int = 0
    log_samples: int = 4
    replay_routing: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"rl.group_size must be >= 2 (the advantages compare a prompt's completions), got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(
                f"rl.max_new_tokens must be >= 1 (the completion budget), got {self.max_new_tokens}"
            )
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(
                f"rl.temperature must be > 0 and rl.top_p in (0, 1], got {self.temperature}, {self.top_p}"
            )
        if self.iterations < 1 or self.beta < 0 or self.epsilon <= 0:
            raise ValueError("rl.iterations must be >= 1, rl.beta >= 0 and rl.epsilon > 0")


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """(reward − the group's mean) [/ (the group's std + 1e-4)] of [prompts · group] rewards (std with
    Bessel's correction, as TRL's)."""
    grouped = rewards.double().view(-1, group)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return centered.reshape(-1).float()


class GRPOTask:
    """GRPO (see the module docstring). Metrics per step (`metric_names`): `reward` and `reward_std`
    (over the step's rollouts), `completion_length` (tokens), `clip_fraction` (completion tokens whose
    ratio was clipped), `kl` (mean k3 per token, with `beta` > 0)."""

    config_type = GRPOConfig
    config_section = "rl"
    supports_context_parallel = False
    supports_eval = False  # its microbatches are rollouts, made in prepare_step: no held-out loss
    metric_names = _SUMS

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.reward = _reward_function(config.reward)
        self._prompts: Any = None
        self._run_dir: Path | None = None
        self._rollouts: list[dict[str, torch.Tensor]] = []  # the current generation's microbatches
        self._generated_at = 0  # the step whose generation they are
        # the models whose fused heads return per-token losses (weakly: a model's id can be reused)
        self._per_token_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # ------------------------------------------------------------------ before the steps

    def prepare_run(self, context: PrepareRunContext) -> None:
        """Keep the prompt set, the run directory; the model's fused head returns per-token losses of
        the sampling temperature's distribution."""
        prompts = context.datasets.get("train")
        if prompts is None or not callable(getattr(prompts, "record", None)):
            raise TrainingError(
                "GRPOTask needs a prompt set (providers.dataset: d9d.trainer:PromptDatasetProvider): its lines' "
                "fields go to the reward function"
            )
        if self.config.beta > 0 and not lora_parameters(context.model):
            raise TrainingError(
                f"rl.beta={self.config.beta} needs the starting weights as the reference: train with peft.lora (the "
                "reference is the base model, adapters off), or set rl.beta: 0"
            )
        if self.config.replay_routing and not moe_layers(context.model):
            raise TrainingError(
                "rl.replay_routing replays the experts of d9d's MoE layers and the model has none: set "
                "rl.replay_routing: false, or train an MoE on the reference model (model.moe; a Hugging Face "
                "MoE folder with model.backend: reference)"
            )
        self._prompts, self._run_dir = prompts, context.run_dir
        set_head_reduction(context.model, "none", temperature=self.config.temperature)
        self._per_token_models.add(context.model)

    def prepare_step(self, context: PrepareStepContext) -> list[dict[str, torch.Tensor]]:
        """This rank's rollout microbatches of step `context.step`: generated now every `iterations`
        steps, else the last generation's again."""
        if self._rollouts and (context.step - 1) % self.config.iterations != 0:
            return self._rollouts
        microbatches = next(context.data)
        model = context.model
        was_training = model.training
        model.eval()
        try:
            with context.forward():
                self._rollouts = [self._generate(model, mb, context) for mb in microbatches]
        finally:
            model.train(was_training)
        self._generated_at = context.step
        return self._rollouts

    def _generate(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], context: PrepareStepContext
    ) -> dict[str, torch.Tensor]:
        c = self.config
        prompts = [batch["prompt_ids"][i, : int(n)] for i, n in enumerate(batch["prompt_lengths"])]
        indices = [int(i) for i in batch["index"]]
        eos = getattr(self._prompts.tokenizer, "eos_id", None)
        stops = (*c.stop_ids, *([eos] if eos is not None else []))
        agree = (
            _agreement(context.context.device)
            if dist.is_initialized() and dist.get_world_size() > 1
            else None
        )
        tp = context.context.axis_size("tp") if not context.context.is_local else 1
        groups: list[Rollouts | None] = [None] * len(prompts)
        buckets = [
            [k for k, p in enumerate(prompts) if p.numel() == n]
            for n in dict.fromkeys(p.numel() for p in prompts)
        ]
        # every rank samples as many batches (each forward may gather weights): a rank with fewer
        # prompt lengths samples its first batch again and discards it
        calls = _agreed_max(len(buckets), context.context.device) if agree is not None else len(buckets)
        for call in range(calls):
            chosen = buckets[call] if call < len(buckets) else buckets[0]
            sampled = sample_groups(
                model,
                [prompts[k] for k in chosen],
                c.group_size,
                max_new_tokens=c.max_new_tokens,
                temperature=c.temperature,
                top_p=c.top_p,
                stop_ids=stops,
                generators=[_generator(c.seed, context.step, indices[k]) for k in chosen],
                agree=agree,
                multiple=tp,
                routing=c.replay_routing,
            )
            if call < len(buckets):
                for k, rollouts in zip(chosen, sampled, strict=True):
                    groups[k] = rollouts
        done = [g for g in groups if g is not None]
        rewards = self._score(done, indices)
        advantages = group_advantages(rewards, c.group_size, c.scale_rewards == "group")
        out = rollout_batch(prompts, done, advantages, rewards, multiple=tp)
        if c.beta > 0:  # the reference: the base model (adapters off), on the same tokens
            with lora_disabled(model):
                out["ref_logps"] = self._token_logps(model, out, context.context.device).detach().cpu()
        self._log_samples(context, prompts, done, rewards, advantages)
        return out

    def _score(self, groups: Sequence[Rollouts], indices: Sequence[int]) -> torch.Tensor:
        """The reward of every completion, [prompts · G] float64, from the user's function."""
        tokenizer, g = self._prompts.tokenizer, self.config.group_size
        texts, completions, fields = [], [], {}
        for group, index in zip(groups, indices, strict=True):
            record = self._prompts.record(index)
            prompt_text = self._prompts.prompt_text(index)
            for row in range(g):
                texts.append(prompt_text)
                completions.append(tokenizer.decode(group.tokens[row, : int(group.lengths[row])].tolist()))
                for key, value in record.items():
                    if key != "prompt":
                        fields.setdefault(key, []).append(value)
        try:
            values = self.reward(prompts=texts, completions=completions, **fields)
            rewards = torch.tensor([float(v) for v in values], dtype=torch.float64)
        except Exception as exc:
            raise TrainingError(
                f"rl.reward ({self.config.reward}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        if rewards.shape != (len(completions),) or not bool(torch.isfinite(rewards).all()):
            raise TrainingError(
                f"rl.reward ({self.config.reward}) must return one finite number per completion: got "
                f"{tuple(rewards.shape)} for {len(completions)} completions"
            )
        return rewards

    def _log_samples(self, context: PrepareStepContext, prompts: Sequence[torch.Tensor], groups: Sequence[Rollouts],
                     rewards: torch.Tensor, advantages: torch.Tensor) -> None:  # fmt: skip
        if not context.context.is_main_process or self._run_dir is None or self.config.log_samples < 1:
            return
        tokenizer, g = self._prompts.tokenizer, self.config.group_size
        lines = []
        for i, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
            for row in range(g):
                if len(lines) == self.config.log_samples:
                    break
                k = i * g + row
                lines.append({"step": context.step, "prompt": tokenizer.decode(prompt.tolist()),
                              "completion": tokenizer.decode(group.tokens[row, : int(group.lengths[row])].tolist()),
                              "reward": float(rewards[k]), "advantage": float(advantages[k])})  # fmt: skip
        folder = self._run_dir / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{context.step}.jsonl"
        if not path.exists() or path.stat().st_size == 0:  # the first microbatch of the step's rollouts
            path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    # ------------------------------------------------------------------ the step

    def batch_weight(self, batch: Any) -> torch.Tensor:
        """The completion tokens of the microbatch (the loss is their mean over the global batch)."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def _token_logps(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        if fused_loss_chunk_size(model) is not None:
            if model not in self._per_token_models:  # the run's model (prepare_run) or the planner's
                set_head_reduction(model, "none", temperature=self.config.temperature)
                self._per_token_models.add(model)
            output = model(input_ids, labels=labels)
        else:
            output = model(input_ids) / self.config.temperature
        return token_logps(output, labels).view(labels.shape)

    def compute_loss(self, context: LossContext) -> LossResult:
        """The clipped policy gradient summed over the microbatch's completion tokens, and its metrics."""
        c, batch, device = self.config, context.batch, context.device
        if c.replay_routing:  # kept through the backward (a checkpointed recompute); the step clears it
            routing = batch.get("routing")
            set_replayed_routing(context.model, routing.unbind(2) if routing is not None else None)
        logps = self._token_logps(context.model, batch, device)
        labels = batch["labels"].to(device)
        mask = (labels != IGNORE_INDEX).float()
        old = batch["old_logps"].to(device)
        advantages = batch["advantages"].to(device)[:, None]
        ratio = torch.exp(logps - old)
        low, high = 1 - c.epsilon, 1 + (c.epsilon_high if c.epsilon_high is not None else c.epsilon)
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
        kl = torch.zeros_like(per_token)
        if c.beta > 0:
            delta = batch["ref_logps"].to(device) - logps
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + c.beta * kl
        clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
        rewards = batch["rewards"].to(device, torch.float64)
        metrics = {
            "reward_sum": rewards.sum(),
            "reward_sq_sum": (rewards * rewards).sum(),
            "rollouts": torch.tensor(float(rewards.numel()), dtype=torch.float64),
            "clipped_tokens": (clipped.float() * mask).sum().detach(),
            "kl_sum": (kl * mask).sum().detach(),
        }
        return LossResult(loss_sum=(per_token * mask).sum(), weight=mask.sum(), metrics=metrics)

    def planning_batch(self, microbatch_size: int, seq_len: int, packed: bool) -> dict[str, torch.Tensor]:
        """A meta rollout microbatch (`ShapesBatch`): `group_size` rows per prompt of `seq_len` tokens
        (the prompt budget plus `max_new_tokens`: `d9d plan --seq-len`)."""
        del packed
        rows = microbatch_size * self.config.group_size
        batch = {
            key: torch.zeros(rows, seq_len, dtype=torch.long, device="meta")
            for key in ("input_ids", "labels")
        }
        batch["old_logps"] = torch.zeros(rows, seq_len, device="meta")
        batch |= {key: torch.zeros(rows, device="meta") for key in ("advantages", "rewards")}
        if self.config.beta > 0:
            batch["ref_logps"] = torch.zeros(rows, seq_len, device="meta")
        return batch

    def summarize_metrics(self, sums: Mapping[str, float], weight: float) -> dict[str, float]:
        """The logged values from the global sums: reward mean and std over the rollouts, completion
        length, the share of clipped tokens, the mean KL per token."""
        n = max(sums["rollouts"], 1.0)
        mean = sums["reward_sum"] / n
        out = {
            "reward": mean,
            "reward_std": math.sqrt(max(sums["reward_sq_sum"] / n - mean * mean, 0.0)),
            "completion_length": weight / n,
            "clip_fraction": sums["clipped_tokens"] / weight if weight else float("nan"),
        }
        if self.config.beta > 0:
            out["kl"] = sums["kl_sum"] / weight if weight else float("nan")
        return out

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """The current generation's rollouts (reused for `iterations` steps) and its step."""
        return {
            "generated_at": self._generated_at,
            "rollouts": [{key: tensor_state(t) for key, t in mb.items()} for mb in self._rollouts],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's rollouts (`state_dict`)."""
        self._generated_at = int(state.get("generated_at", 0))
        self._rollouts = [
            {key: tensor_from_state(entry) for key, entry in mb.items()} for mb in state.get("rollouts", [])
        ]


def _generator(seed: int, step: int, index: int) -> torch.Generator:
    """The generator of one prompt's completions at one step: the same on every rank and mesh."""
    mixed = np.random.SeedSequence([seed, step, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & (2**63 - 1))


def _agreed_max(count: int, device: torch.device) -> int:
    """The largest `count` over all ranks (one all-reduce)."""
    value = torch.tensor([float(count)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _agreement(device: torch.device) -> Callable[[bool], bool]:
    """Whether any rank still samples (one all-reduce per token: every rank runs as many forwards)."""

    def agree(unfinished: bool) -> bool:
        flag = torch.tensor([1.0 if unfinished else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    return agree


def _reward_function(spec: str) -> Callable[..., Sequence[float]]:
    function = resolve_object(spec, Path("/"), key="rl.reward")
    if not callable(function):
        raise ValueError(f"rl.reward ({spec}) is not a function; name one that takes prompts=, completions=")
    return function
