"""The reference model's KV cache: the prompt and then token by token give the logits of one whole
forward, and d9d's `generate` with the cache writes what a re-forward of the whole sequence writes."""

import pytest
import torch

from d9d.trainer import SamplingConfig, generate
from d9d.trainer.generation import GenerationError
from d9d.trainer.models import MoEConfig, ReferenceForCausalLM, ReferenceModelConfig


def _model(**overrides) -> ReferenceForCausalLM:
    fields = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10_000.0, max_position_embeddings=64, initializer_range=0.2)  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(0)
    return ReferenceForCausalLM(ReferenceModelConfig(**fields)).eval()


class _NoCache(torch.nn.Module):
    """The same model without `new_kv_cache`: generate re-runs the whole sequence for every token."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"qkv_bias": True, "qk_norm": False}, {"num_key_value_heads": 4},
     {"moe": MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=16)}],
    ids=["qwen3", "qwen2-biases", "mha", "moe"],
)  # fmt: skip
def test_cached_pieces_give_the_logits_of_one_forward(overrides):
    model = _model(**overrides)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_kv_cache(24)
        pieces = [model(ids[:, a:b], kv_cache=cache) for a, b in [(0, 7), (7, 8), (8, 13), (13, 20)]]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0), dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)]
)
def test_generate_with_the_cache_writes_what_a_re_forward_writes(sampling):
    model = _model()
    prompt = [5, 17, 3, 88, 41]
    config = SamplingConfig(max_new_tokens=30, **sampling)
    cached = generate(model, prompt, config)
    plain = generate(_NoCache(model), prompt, config)
    assert (cached.method, plain.method) == ("kv_cache", "re_forward")
    assert cached.ids == plain.ids and len(cached.ids) == 30 and cached.finish == "length"
    assert len(set(cached.ids)) > 3  # a real continuation, not one token repeated


def test_generation_stops_at_a_stop_token_and_refuses_more_than_the_positions():
    model = _model()
    first = generate(model, [1, 2, 3], SamplingConfig(max_new_tokens=10, temperature=0)).ids
    stopped = generate(
        model, [1, 2, 3], SamplingConfig(max_new_tokens=10, temperature=0, stop_ids=(first[2],))
    )
    cut = first.index(first[2]) + 1
    assert stopped.ids == first[:cut] and stopped.finish == "stop"
    with pytest.raises(GenerationError, match="generate at most 54 new tokens"):
        generate(model, list(range(10)), SamplingConfig(max_new_tokens=60))
    with pytest.raises(GenerationError, match="the prompt has 64 tokens; the model takes at most 64"):
        generate(model, [1] * 64, SamplingConfig(max_new_tokens=1))
    with pytest.raises(ValueError, match="the KV cache holds 4 tokens; 5 were asked for"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=model.new_kv_cache(4))
