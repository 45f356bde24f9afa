"""Sampling text from a trained model on one process: the prompt once, then one token per forward.

Three ways to run the model, chosen from what it offers:

- `kv_cache`: the model has `new_kv_cache(max_length)` and its forward takes `kv_cache=` (the
  reference model): the prompt is run once, then each new token alone against the cached keys and values.
- `hf_cache`: a Hugging Face model (its forward takes `use_cache` and the cache as `cache`, or
  `past_key_values` before transformers 5.x renamed it): its own cache.
- `re_forward`: anything else: the whole sequence again for every new token.

Each new token is drawn on the host from the float32 probabilities, with a `torch.Generator` seeded
by `SamplingConfig.seed`, so one seed gives the same tokens on every run (and the same on any device
that computes the same probabilities). Temperature 0 is greedy.
"""

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from d9d.trainer.errors import TrainingError

__all__ = ["GenerationError", "GenerationResult", "SamplingConfig", "generate", "max_positions"]

Method = Literal["kv_cache", "hf_cache", "re_forward"]


class GenerationError(TrainingError, ValueError):
    """A generation request the model cannot serve (too long a prompt, bad sampling settings)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each new token.

    Attributes:
        max_new_tokens: tokens to generate at most (fewer when a stop token comes).
        temperature: divides the logits before the softmax; 0 picks the most likely token (greedy).
        top_k: sample among the k most likely tokens only (None: all).
        top_p: sample among the most likely tokens whose probabilities add up to at least p (None: all).
        seed: seeds the generator the tokens are drawn with.
        stop_ids: token ids that end the text (e.g. the tokenizer's end of document); kept in the output.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens is {self.max_new_tokens}; generate at least 1 token")
        if self.temperature < 0:
            raise GenerationError(f"temperature is {self.temperature}; use 0 (greedy) or a positive value")
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(f"top_k is {self.top_k}; use a positive count or leave it out")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p is {self.top_p}; use a value in (0, 1] or leave it out")


@dataclass(frozen=True)
class GenerationResult:
    """What `generate` produced: the new token ids (after the prompt), why it stopped, and how it ran."""

    ids: list[int]
    finish: Literal["stop", "length"]
    method: Method


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model is meant for (`config.max_position_embeddings`), if it says."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def method_of(model: torch.nn.Module) -> Method:
    """How `generate` runs `model` (see the module's docstring)."""
    if callable(getattr(model, "new_kv_cache", None)):
        return "kv_cache"
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "re_forward"
    if "use_cache" in parameters and _hf_cache_argument(parameters) is not None:
        return "hf_cache"
    return "re_forward"


def _hf_cache_argument(parameters: Any) -> str | None:
    """The name a Hugging Face forward takes its cache by (`cache`; `past_key_values` before 5.x)."""
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def check_length(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse an empty prompt, or one that with its new tokens is longer than the model's positions."""
    if prompt_tokens == 0:
        raise GenerationError("the prompt has no tokens; pass a prompt with some text")
    limit = max_positions(model)
    if limit is None:
        return
    if prompt_tokens >= limit:
        raise GenerationError(
            f"the prompt has {prompt_tokens} tokens; the model takes at most {limit} positions "
            "(max_position_embeddings): shorten the prompt"
        )
    if prompt_tokens + max_new_tokens > limit:
        raise GenerationError(
            f"the prompt's {prompt_tokens} tokens and {max_new_tokens} new ones pass the model's {limit} "
            f"positions (max_position_embeddings); generate at most {limit - prompt_tokens} new tokens"
        )


def pick(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from a row of logits [vocab] (see `SamplingConfig`)."""
    scores = logits.detach().float().cpu()
    if config.temperature == 0:
        return int(scores.argmax())
    scores = scores / config.temperature
    if config.top_k is not None and config.top_k < scores.numel():
        kth = torch.topk(scores, config.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens more likely than each
        drop = before >= config.top_p  # the most likely token is always kept (its `before` is 0)
        scores = scores.index_put((order[drop],), torch.tensor(float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _logits(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, or an object with `.logits` (Hugging Face)."""
    return output if isinstance(output, torch.Tensor) else output.logits


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt_ids: Sequence[int], config: SamplingConfig) -> GenerationResult:
    """The tokens `model` continues `prompt_ids` with (one row, on the model's device; see the module).

    Raises:
        GenerationError: an empty prompt, or one that with `max_new_tokens` is longer than the
            model's positions.
    """
    check_length(model, len(prompt_ids), config.max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        device = next(iter(model.parameters())).device
        generator = torch.Generator().manual_seed(config.seed)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        method = method_of(model)
        state: Any = None
        if method == "kv_cache":
            state = model.new_kv_cache(len(prompt_ids) + config.max_new_tokens)  # type: ignore[operator]
            logits = _logits(model(ids, kv_cache=state))
        elif method == "hf_cache":
            cache_name = _hf_cache_argument(inspect.signature(model.forward).parameters)
            output = model(input_ids=ids, use_cache=True)
            logits, state = output.logits, output[cache_name]
        else:
            logits = _logits(model(ids))
        new: list[int] = []
        stops = set(config.stop_ids)
        while True:
            token = pick(logits[0, -1], config, generator)
            new.append(token)
            if token in stops:
                return GenerationResult(new, "stop", method)
            if len(new) == config.max_new_tokens:
                return GenerationResult(new, "length", method)
            step = torch.tensor([[token]], dtype=torch.long, device=device)
            if method == "kv_cache":
                logits = _logits(model(step, kv_cache=state))
            elif method == "hf_cache":
                output = model(input_ids=step, use_cache=True, **{cache_name: state})
                logits, state = output.logits, output[cache_name]
            else:
                ids = torch.cat([ids, step], dim=1)
                logits = _logits(model(ids))
    finally:
        model.train(was_training)
