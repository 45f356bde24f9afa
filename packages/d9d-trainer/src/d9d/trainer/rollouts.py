"""Rollouts for RL: a group of completions of one prompt sampled from the current weights, with the
log-probability of every sampled token, on any data-parallel mesh.

`sample_group` runs the model the way `d9d.trainer.generation` does (the reference model's KV cache,
else, and under tensor parallelism, the whole sequence again per token), on all `G` completions of a prompt at once (they share the
prompt, so one cache serves the batch). Tokens are drawn on the host from the float32 probabilities
with the given generator, so a prompt's completions depend on its seed and the weights only, not on
the rank or mesh that samples them. Every rank must run as many forwards (FSDP gathers weights in
each): with `agree`, the ranks decide together after each token whether any completion is unfinished.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from d9d.data import IGNORE_INDEX
from d9d.trainer.generation import GenerationError, method_of

__all__ = ["Rollouts", "rollout_batch", "sample_group"]


@dataclass(frozen=True)
class Rollouts:
    """`G` completions of one prompt.

    Attributes:
        tokens: [G, T] the sampled ids (T: the longest completion); after a completion's stop token,
            padding (0).
        logps: [G, T] float32 log-probability of each sampled token under the sampling distribution
            before top-p (the logits divided by the temperature), 0 after the end.
        lengths: [G] tokens of each completion, its stop token included.
    """

    tokens: torch.Tensor
    logps: torch.Tensor
    lengths: torch.Tensor


def _draw(
    logits: torch.Tensor, temperature: float, top_p: float | None, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [G, vocab] and its log-probability (float32, logits / temperature)."""
    scaled = logits.float() / temperature
    logprobs = F.log_softmax(scaled, dim=-1)
    scores = scaled.detach().cpu()
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # the most likely token always stays
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(-1)
    picked = logprobs.gather(-1, tokens.to(logprobs.device).unsqueeze(-1)).squeeze(-1)
    return tokens, picked.detach()


def sample_group(model: torch.nn.Module, prompt: torch.Tensor, group: int, *, generator: torch.Generator,
                 **options: Any) -> Rollouts:  # fmt: skip
    """`group` completions of one `prompt` ([length] ids): `sample_groups` of one prompt."""
    return sample_groups(model, [prompt], group, generators=[generator], **options)[0]


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    group: int,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float | None,
    stop_ids: Sequence[int],
    generators: Sequence[torch.Generator],
    agree: Callable[[bool], bool] | None = None,
    multiple: int = 1,
) -> list[Rollouts]:
    """`group` completions of each of `prompts` (ids of one length: one batch of prompts · group rows,
    one cache) sampled from `model` (put it in eval mode first); prompt k's tokens are drawn with
    `generators[k]` alone, so they do not depend on the prompts sampled beside it.

    Args:
        agree: given whether this rank still has an unfinished completion, whether any rank does
            (e.g. an all-reduce); None on one process.
        multiple: the sequence length the model needs a multiple of (tensor parallelism's sequence
            parallel: tp): without a KV cache the sequence is right-padded to it (causal: the padding
            changes none of the real positions' logits).

    Raises:
        GenerationError: an empty prompt, prompts of several lengths, a temperature that is not
            positive, no token budget.
    """
    lengths_in = {p.numel() for p in prompts}
    if 0 in lengths_in or len(lengths_in) != 1 or len(generators) != len(prompts):
        raise GenerationError("sample_groups takes non-empty prompts of one length, with a generator each")
    if not temperature > 0 or max_new_tokens < 1:
        raise GenerationError(
            f"sampling needs temperature > 0 and max_new_tokens >= 1, got {temperature} and {max_new_tokens}"
        )
    device = next(iter(model.parameters())).device
    ids = torch.stack(list(prompts)).to(device).repeat_interleave(group, dim=0)
    rows = ids.shape[0]
    cached = method_of(model) == "kv_cache" and not _tensor_parallel(model)
    cache = model.new_kv_cache(ids.shape[1] + max_new_tokens) if cached else None  # type: ignore[operator]
    logits = _last_logits(model(ids, kv_cache=cache)) if cached else _padded_logits(model, ids, multiple)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    tokens, logps = [], []
    done = torch.zeros(rows, dtype=torch.bool)
    lengths = torch.zeros(rows, dtype=torch.long)
    for _ in range(max_new_tokens):
        drawn = [_draw(logits[k * group : (k + 1) * group], temperature, top_p, generator)
                 for k, generator in enumerate(generators)]  # fmt: skip
        token = torch.cat([t for t, _ in drawn])
        logp = torch.cat([lp for _, lp in drawn])
        token = torch.where(done, torch.zeros_like(token), token)
        tokens.append(token)
        logps.append(torch.where(done.to(logp.device), torch.zeros_like(logp), logp))
        lengths += (~done).long()
        done |= torch.isin(token, stops)
        unfinished = not bool(done.all())
        if not (agree(unfinished) if agree is not None else unfinished) or len(tokens) == max_new_tokens:
            break
        step = token.to(device).unsqueeze(1)
        if cached:
            logits = _last_logits(model(step, kv_cache=cache))
        else:
            ids = torch.cat([ids, step], dim=1)
            logits = _padded_logits(model, ids, multiple)
    all_tokens, all_logps = torch.stack(tokens, 1), torch.stack(logps, 1).float().cpu()
    return [
        Rollouts(
            all_tokens[k * group : (k + 1) * group],
            all_logps[k * group : (k + 1) * group],
            lengths[k * group : (k + 1) * group],
        )
        for k in range(len(prompts))
    ]


def _padded_logits(model: torch.nn.Module, ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """The last real position's logits of `ids`, run right-padded (with 0) to a multiple of `multiple`."""
    length = ids.shape[1]
    padded = -(-length // multiple) * multiple
    if padded != length:
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], padded - length)], dim=1)
    output = model(ids)
    logits = output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]
    return logits[:, length - 1]


def _tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether a parameter is split over a tensor-parallel mesh dim (its sequence-parallel activations
    do not fit the KV cache: the whole sequence is run again per token)."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        if mesh is not None and any(name == "tp" and mesh.size(i) > 1 for i, name in enumerate(names)):
            return True
    return False


def _last_logits(output: object) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[attr-defined]
    return logits[:, -1]


def rollout_batch(
    prompts: Sequence[torch.Tensor],
    groups: Sequence[Rollouts],
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """One training microbatch of rollouts: a row per completion (prompt, then completion, right-padded
    with 0 to the longest, rounded up to a multiple of `multiple`), `labels` the completion's tokens
    (shifted: at the position that predicts each), `old_logps` the sampling log-probabilities at the
    same positions, and each row's `advantages` and `rewards`."""
    rows = sum(g.tokens.shape[0] for g in groups)
    width = max(p.numel() + int(g.lengths.max()) for p, g in zip(prompts, groups, strict=True))
    width = -(-width // multiple) * multiple
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros(rows, width, dtype=torch.float32)
    row = 0
    for prompt, group in zip(prompts, groups, strict=True):
        start = prompt.numel()
        for g in range(group.tokens.shape[0]):
            n = int(group.lengths[g])
            input_ids[row, :start] = prompt
            input_ids[row, start : start + n] = group.tokens[g, :n]
            labels[row, start - 1 : start + n - 1] = group.tokens[g, :n]
            old_logps[row, start - 1 : start + n - 1] = group.logps[g, :n]
            row += 1
    return {
        "input_ids": input_ids,
        "labels": labels,
        "old_logps": old_logps,
        "advantages": advantages.float(),
        "rewards": rewards.float(),
    }
