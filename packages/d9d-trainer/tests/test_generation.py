"""d9d.trainer's sampler: greedy, top-k and top-p keep exactly the tokens they say, a seed repeats its
draws, and bad settings are refused in one line."""

import pytest
import torch

from d9d.trainer import SamplingConfig
from d9d.trainer.generation import GenerationError, method_of, pick

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])  # probabilities ~ .23 .08 .05 .03 .01 .62


def _draws(config: SamplingConfig, n: int = 400) -> list[int]:
    generator = torch.Generator().manual_seed(config.seed)
    return [pick(LOGITS, config, generator) for _ in range(n)]


def test_temperature_zero_is_the_most_likely_token():
    assert set(_draws(SamplingConfig(max_new_tokens=1, temperature=0), n=5)) == {5}


def test_top_k_and_top_p_sample_only_among_the_tokens_they_keep():
    everything = set(_draws(SamplingConfig(max_new_tokens=1, temperature=1.0)))
    assert everything == set(range(6))  # 400 draws reach even the 1% token
    assert set(_draws(SamplingConfig(max_new_tokens=1, top_k=2))) == {5, 0}
    # token 5 alone holds .62 < .8: token 0 (.23) is needed too; .62 + .23 = .85 >= .8: nothing more
    assert set(_draws(SamplingConfig(max_new_tokens=1, top_p=0.8))) == {5, 0}
    assert set(_draws(SamplingConfig(max_new_tokens=1, top_p=0.5))) == {5}  # the likeliest always stays
    hot = _draws(SamplingConfig(max_new_tokens=1, temperature=5.0))
    cold = _draws(SamplingConfig(max_new_tokens=1, temperature=0.2))
    assert hot.count(5) < 200 < cold.count(5)  # temperature flattens or sharpens the distribution


def test_a_seed_repeats_its_draws():
    config = SamplingConfig(max_new_tokens=1, seed=7)
    assert _draws(config) == _draws(config)
    assert _draws(config) != _draws(SamplingConfig(max_new_tokens=1, seed=8))


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"max_new_tokens": 0}, "generate at least 1 token"), ({"temperature": -1}, "use 0 (greedy)"),
     ({"top_k": 0}, "top_k is 0"), ({"top_p": 1.5}, "top_p is 1.5; use a value in (0, 1]")],
)  # fmt: skip
def test_bad_settings_are_refused(fields, message):
    with pytest.raises(
        GenerationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        SamplingConfig(**{"max_new_tokens": 4, **fields})


def test_the_way_a_model_runs_comes_from_what_it_offers():
    class Plain(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    class HFStyle(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
            return input_ids

    class Cached(Plain):
        def new_kv_cache(self, max_length):
            return max_length

    assert [method_of(m()) for m in (Plain, HFStyle, Cached)] == ["re_forward", "hf_cache", "kv_cache"]
