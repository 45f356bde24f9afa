"""RoPE scaling: the inverse frequencies and cos/sin scale equal transformers' own, bit for bit.

transformers (a dev-only dependency) is the reference; those tests are skipped without it.
"""

import msgspec
import pytest
import torch

from d9d.trainer.models import (
    Llama3RopeScaling,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    ReferenceModelConfigError,
    YarnRopeScaling,
    from_hf_config,
    rope_attention_factor,
    rope_inverse_frequencies,
)

#: rope_parameters of transformers' configs: Llama 3.1's own, and yarn's corners (mscale pair, given
#: attention factor, no truncation, non-default betas).
ROPES = {
    "llama3.1": dict(
        rope_type="llama3",
        rope_theta=500_000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    "llama3-narrow": dict(
        rope_type="llama3",
        rope_theta=10_000.0,
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "linear": dict(rope_type="linear", rope_theta=10_000.0, factor=2.0),
    "yarn": dict(
        rope_type="yarn", rope_theta=1_000_000.0, factor=4.0, original_max_position_embeddings=32768
    ),
    "yarn-mscale-untruncated": dict(
        rope_type="yarn",
        rope_theta=10_000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=0.707,
        truncate=False,
    ),
    "yarn-attention-factor-betas": dict(
        rope_type="yarn",
        rope_theta=10_000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        attention_factor=0.8,
        beta_fast=8.0,
        beta_slow=2.0,
    ),
}


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("name", ROPES)
def test_frequencies_and_attention_factor_equal_transformers_bitwise(name, head_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(ROPES[name]),
    )
    theirs, their_factor = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf, "cpu")
    config = from_hf_config(hf.to_dict())
    ours = rope_inverse_frequencies(head_dim, config.rope_theta, config.rope_scaling)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)
    assert rope_attention_factor(config.rope_scaling) == their_factor
    plain = rope_inverse_frequencies(head_dim, config.rope_theta)
    assert not torch.equal(ours, plain) or their_factor != 1.0  # the case scales something


def test_no_scaling_is_todays_rope():
    freqs = rope_inverse_frequencies(8, 10_000.0)
    expected = 1.0 / (10_000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert torch.equal(freqs, expected)
    assert rope_attention_factor(None) == 1.0


def test_yarn_scales_cos_and_sin_and_a_bf16_model_keeps_fp32_angles():
    scaling = YarnRopeScaling(factor=4.0, original_max_position_embeddings=64)
    config = ReferenceModelConfig(
        vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1, num_attention_heads=2,
        rope_theta=10_000.0, rope_scaling=scaling,
    )  # fmt: skip
    rotary = ReferenceForCausalLM(config).model.rotary_emb
    positions = torch.arange(5).unsqueeze(0)
    cos, sin = rotary(positions, torch.float32)
    angles = positions[0, :, None].float() * rope_inverse_frequencies(16, 10_000.0, scaling)
    factor = rope_attention_factor(scaling)
    assert factor > 1.0
    torch.testing.assert_close(cos[0, :, :8], angles.cos() * factor, rtol=0, atol=0)
    torch.testing.assert_close(sin[0, :, 8:], angles.sin() * factor, rtol=0, atol=0)
    rotary.to(torch.bfloat16)
    cos_bf16, _ = rotary(positions, torch.bfloat16)
    assert torch.equal(cos_bf16, cos.to(torch.bfloat16))


def test_rope_scaling_from_a_yaml_section_and_its_errors():
    base = dict(vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1, num_attention_heads=2)
    llama3 = dict(rope_type="llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
                  original_max_position_embeddings=8192)  # fmt: skip
    config = ReferenceModelConfig.from_dict({**base, "rope_scaling": llama3})
    assert config.rope_scaling == Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert ReferenceModelConfig.from_dict(msgspec.to_builtins(config)) == config
    with pytest.raises(
        msgspec.ValidationError, match=r"Invalid value .dynamic. - at `\$\.rope_scaling\.rope_type`"
    ):
        ReferenceModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `beta_fast`"):
        ReferenceModelConfig.from_dict({**base, "rope_scaling": {**llama3, "beta_fast": 32}})
    with pytest.raises(ReferenceModelConfigError, match=r"model\.rope_scaling\.high_freq_factor=1"):
        Llama3RopeScaling(factor=8, low_freq_factor=1, high_freq_factor=1, original_max_position_embeddings=8)
    with pytest.raises(ReferenceModelConfigError, match=r"model\.rope_scaling\.factor=0"):
        YarnRopeScaling(factor=0, original_max_position_embeddings=8)
