"""Rollouts for RL: a group of completions of one prompt sampled from the current weights, with the
log-probability of every sampled token, on any data-parallel mesh.

`sample_group` runs the model the way `d9d.trainer.generation` does (the reference model's KV cache,
else, and under tensor parallelism, the whole sequence again per token), on all `G` completions of a prompt at once (they share the
prompt, so one cache serves the batch). Tokens are drawn on the host from the float32 probabilities
with the given generator, so a prompt's completions depend on its seed and the weights only, not on
the rank or mesh that samples them. Every rank must run as many forwards (FSDP gathers weights in
each): with `agree`, the ranks decide together after each token whether any completion is unfinished.
With `record_routing`, the experts every MoE layer chose for every token fed (the prompt's and each
completion token's) come back too, laid out per row and position like the tokens, for the training
forward to replay (`d9d.parallel.expert.replay_routing`).
"""

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from d9d.data import IGNORE_INDEX
from d9d.parallel.expert import record_routing
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
        routing: with `record_routing`, [G, prompt + T, MoE layers, top_k] int64: the experts each MoE
            layer chose for the token at each position (prompt, then completion); -1 where no token
            was fed (a row's last sampled one). None: not recorded.
    """

    tokens: torch.Tensor
    logps: torch.Tensor
    lengths: torch.Tensor
    routing: torch.Tensor | None = None


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
    routing: bool = False,
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
        routing: record the MoE layers' experts of every position fed (`Rollouts.routing`).

    Raises:
        GenerationError: an empty prompt, prompts of several lengths, a temperature that is not
            positive, no token budget.
    """
    _check(prompts, generators, temperature, max_new_tokens)
    device = next(iter(model.parameters())).device
    ids = torch.stack(list(prompts)).to(device).repeat_interleave(group, dim=0)
    rows = ids.shape[0]
    cached = method_of(model) == "kv_cache" and not _tensor_parallel(model)
    cache = model.new_kv_cache(ids.shape[1] + max_new_tokens) if cached else None  # type: ignore[operator]
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
    tokens, logps = [], []
    done = torch.zeros(rows, dtype=torch.bool)
    lengths = torch.zeros(rows, dtype=torch.long)
    spans = [(0, 0, ids.shape[1])]  # per forward: (its first position, the new positions' start, end)
    with record_routing(model) if routing else nullcontext() as records:
        logits = _last_logits(model(ids, kv_cache=cache)) if cached else _padded_logits(model, ids, multiple)
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
            end = spans[-1][2] + 1
            spans.append((end - 1 if cached else 0, end - 1, end))
            if cached:
                logits = _last_logits(model(step, kv_cache=cache))
            else:
                ids = torch.cat([ids, step], dim=1)
                logits = _padded_logits(model, ids, multiple)
    all_tokens, all_logps = torch.stack(tokens, 1), torch.stack(logps, 1).float().cpu()
    experts = _routing(records, spans, rows, spans[0][2] + len(tokens)) if records is not None else None
    return [
        Rollouts(
            all_tokens[k * group : (k + 1) * group],
            all_logps[k * group : (k + 1) * group],
            lengths[k * group : (k + 1) * group],
            experts[k * group : (k + 1) * group] if experts is not None else None,
        )
        for k in range(len(prompts))
    ]


def _check(prompts: Sequence[torch.Tensor], generators: Sequence[torch.Generator], temperature: float,
           max_new_tokens: int) -> None:  # fmt: skip
    lengths_in = {p.numel() for p in prompts}
    if 0 in lengths_in or len(lengths_in) != 1 or len(generators) != len(prompts):
        raise GenerationError("sample_groups takes non-empty prompts of one length, with a generator each")
    if not temperature > 0 or max_new_tokens < 1:
        raise GenerationError(
            f"sampling needs temperature > 0 and max_new_tokens >= 1, got {temperature} and {max_new_tokens}"
        )


def _routing(records: list[list[torch.Tensor]], spans: Sequence[tuple[int, int, int]], rows: int,
             total: int) -> torch.Tensor:  # fmt: skip
    """[rows, total, MoE layers, top_k] experts per position from the recorded forwards (each forward's
    [rows · its length, top_k], its new positions at `spans`); -1 where nothing was fed."""
    layers = []
    for forwards in records:
        k = forwards[0].shape[-1]
        out = forwards[0].new_full((rows, total, k), -1)
        for record, (offset, start, end) in zip(forwards, spans, strict=True):
            out[:, start:end] = record.view(rows, -1, k)[:, start - offset : end - offset]
        layers.append(out)
    return torch.stack(layers, dim=2).cpu() if layers else torch.full((rows, total, 0, 0), -1)


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
    same positions, and each row's `advantages` and `rewards`. With the groups' `routing`: `routing`
    [rows, width, MoE layers, top_k], each position's recorded experts (-1 past the recorded ones and
    on the padding: the router's own choice)."""
    rows = sum(g.tokens.shape[0] for g in groups)
    width = max(p.numel() + int(g.lengths.max()) for p, g in zip(prompts, groups, strict=True))
    width = -(-width // multiple) * multiple
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros(rows, width, dtype=torch.float32)
    recorded = all(g.routing is not None for g in groups)
    if recorded:
        shape = groups[0].routing.shape[2:]  # type: ignore[union-attr]
        routing = torch.full((rows, width, *shape), -1, dtype=torch.long)
    row = 0
    for prompt, group in zip(prompts, groups, strict=True):
        start = prompt.numel()
        for g in range(group.tokens.shape[0]):
            n = int(group.lengths[g])
            input_ids[row, :start] = prompt
            input_ids[row, start : start + n] = group.tokens[g, :n]
            labels[row, start - 1 : start + n - 1] = group.tokens[g, :n]
            old_logps[row, start - 1 : start + n - 1] = group.logps[g, :n]
            if recorded:
                routing[row, : start + n] = group.routing[g, : start + n]  # type: ignore[index]
            row += 1
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "old_logps": old_logps,
        "advantages": advantages.float(),
        "rewards": rewards.float(),
    }
    return batch | ({"routing": routing} if recorded else {})
