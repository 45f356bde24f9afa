"""Hugging Face families beyond qwen3/llama/qwen3_moe: scaled RoPE, q/k/v biases (Qwen2), Mistral, Mixtral.

Each family starts on transformers' side: a tiny random model built from transformers' own config
class and saved with `save_pretrained` (no download). Import gives transformers' logits (fp32,
atol 1e-5); export gives back every safetensors tensor bit for bit and a config.json that
transformers reads to the same values that matter. Real checkpoints' config.json fields (written
out below from their public files) parse into the right shapes, or are refused with the reason.
Run with: uv run pytest packages/d9d-trainer/tests/models/test_hf_families.py -q
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from d9d.trainer.models import (
    HFConversionError,
    Llama3RopeScaling,
    MoEConfig,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    SlidingWindowError,
    YarnRopeScaling,
    from_hf_config,
    hf_checkpoint_keys,
    hf_expert_layout,
    load_hf_pretrained,
    read_hf_config,
    save_hf_pretrained,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: local folders only
transformers = pytest.importorskip("transformers")

VOCAB = 61
ATOL = 1e-5
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # not hidden / heads, so a lost head_dim would show
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
)
# Pretraining lengths short enough that the 13-token test sequences see every scaled band.
LLAMA3 = dict(rope_type="llama3", rope_theta=10_000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)  # fmt: skip
YARN = dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, original_max_position_embeddings=64)

#: family → transformers' own config of a tiny model of it
FAMILIES: dict[str, Callable[[], Any]] = {
    "llama-llama3": lambda: transformers.LlamaConfig(
        **TINY | {"max_position_embeddings": 256}, rope_parameters=dict(LLAMA3)
    ),
    "llama-linear": lambda: transformers.LlamaConfig(
        **TINY, rope_parameters=dict(rope_type="linear", rope_theta=10_000.0, factor=2.0)
    ),
    "llama-yarn": lambda: transformers.LlamaConfig(
        **TINY | {"max_position_embeddings": 256}, rope_parameters=dict(YARN)
    ),
    "qwen3-yarn-mscale": lambda: transformers.Qwen3Config(
        **TINY, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=0.5, beta_fast=16.0, truncate=False)
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen2-tied-llama3": lambda: transformers.Qwen2Config(
        **TINY | {"max_position_embeddings": 256}, tie_word_embeddings=True, rope_parameters=dict(LLAMA3)
    ),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    "mistral-window-as-long-as-the-sequence": lambda: transformers.MistralConfig(**TINY, sliding_window=13),
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "mixtral-window-yarn": lambda: transformers.MixtralConfig(
        **TINY | {"max_position_embeddings": 256},
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        rope_parameters=dict(YARN),
    ),
}
#: MoE families whose experts transformers 5 also saves fused (`save_original_format=False`)
FUSED = {
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
    ),
}
#: transformers config attributes that decide what a checkpoint computes (and how it is named)
MATTERS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "layer_types",
    "num_local_experts", "num_experts_per_tok", "dtype",
)  # fmt: skip


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights large enough that a mapping mistake moves the logits far beyond ATOL; routers with std 2,
    so rounding never changes a top-k choice."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                param.copy_(2.0 * noise)
            else:
                param.copy_(0.3 * noise)


def tokens(batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


def saved_hf_model(hf_config: Any, folder: Path, **save_options: Any) -> Any:
    """transformers' model of `hf_config`, randomized, saved to `folder`; returned in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    randomize_(model)
    model.save_pretrained(folder, **save_options)
    return model.eval()


def imported(folder: Path) -> ReferenceForCausalLM:
    """The reference model of an HF folder, as a fine-tune builds it: meta, to_empty, init, load."""
    with torch.device("meta"):
        model = ReferenceForCausalLM(read_hf_config(folder))
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_pretrained(model, folder)
    return model.eval()


def max_logit_difference(ours: ReferenceForCausalLM, theirs: Any, input_ids: torch.Tensor) -> float:
    with torch.no_grad():
        mine, reference = ours(input_ids), theirs(input_ids=input_ids).logits
    assert mine.shape == reference.shape
    assert reference.std() > 0.5  # the comparison means something only if the logits are not near zero
    torch.testing.assert_close(mine, reference, atol=ATOL, rtol=1e-5)
    return float((mine - reference).abs().max())


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def assert_same_tensors(exported: Path, source: Path) -> None:
    ours, theirs = safetensors_of(exported), safetensors_of(source)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key


def what_matters(folder: Path) -> dict[str, Any]:
    """The config values of a folder that decide its computation, as transformers reads them, with the
    RoPE tables its rotary embedding builds (so equal scalings written with other keys compare equal)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    values = {name: getattr(config, name, "<absent>") for name in MATTERS}
    rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    return values | {"inv_freq": rotary.inv_freq.tolist(), "attention_scaling": rotary.attention_scaling}


@pytest.mark.parametrize("name", FAMILIES)
def test_import_gives_transformers_logits_and_export_gives_back_the_checkpoint(name, tmp_path):
    source, export = tmp_path / "hf", tmp_path / "export"
    theirs = saved_hf_model(FAMILIES[name](), source)
    ours = imported(source)
    max_logit_difference(ours, theirs, tokens())
    if ours.config.qkv_bias:  # the biases were read: every one of them moves the logits
        assert all(ours.model.layers["0"].self_attn.k_proj.bias.abs() > 0)
    if ours.config.moe is not None:  # the Hub's layout, as save_pretrained writes it by default
        assert hf_expert_layout(hf_checkpoint_keys(source)) == "per_expert"
    if ours.config.rope_scaling is not None:  # the test sequences see the scaling: plain RoPE is off
        plain = ReferenceForCausalLM(msgspec.structs.replace(ours.config, rope_scaling=None)).eval()
        plain.load_state_dict(ours.state_dict())
        with pytest.raises(AssertionError):
            max_logit_difference(plain, theirs, tokens())

    save_hf_pretrained(ours, export)
    assert_same_tensors(export, source)
    assert what_matters(export) == what_matters(source)
    assert read_hf_config(export) == read_hf_config(source)


@pytest.mark.parametrize("name", FUSED)
def test_experts_saved_fused_import_and_export_back_fused(name, tmp_path):
    source, export = tmp_path / "hf", tmp_path / "export"
    theirs = saved_hf_model(FUSED[name](), source, save_original_format=False)
    layout = hf_expert_layout(hf_checkpoint_keys(source))
    assert layout == "fused"
    ours = imported(source)
    max_logit_difference(ours, theirs, tokens())
    save_hf_pretrained(ours, export, expert_layout=layout)
    assert_same_tensors(export, source)
    assert what_matters(export) == what_matters(source)


# ----------------------------------------------------------------------------------- real configs

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
MISTRAL_7B_V0_3 = MISTRAL_7B_V0_1 | {
    "attention_dropout": 0.0,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "transformers_version": "4.42.0.dev0",
    "vocab_size": 32768,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
#: name → (config.json, transformers' config class, what the reference config must hold)
REAL_CONFIGS = {
    "llama-3.1-8b": (LLAMA_3_1_8B, "LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_attention_heads=32,
        kv_heads=8, attention_head_dim=128, qk_norm=False, qkv_bias=False, rms_norm_eps=1e-5,
        rope_theta=500_000.0, rope_scaling=Llama3RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        sliding_window=None, moe=None)),
    "qwen2.5-7b": (QWEN2_5_7B, "Qwen2Config", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_attention_heads=28,
        kv_heads=4, attention_head_dim=128, qk_norm=False, qkv_bias=True, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, sliding_window=None, moe=None)),  # use_sliding_window: false
    "mistral-7b-v0.1": (MISTRAL_7B_V0_1, "MistralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_attention_heads=32,
        kv_heads=8, attention_head_dim=128, qk_norm=False, qkv_bias=False, rms_norm_eps=1e-5,
        rope_theta=10_000.0, rope_scaling=None, sliding_window=4096, moe=None, hf_model_type=None)),
    "mistral-7b-v0.3": (MISTRAL_7B_V0_3, "MistralConfig", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_attention_heads=32,
        kv_heads=8, attention_head_dim=128, qk_norm=False, qkv_bias=False, rms_norm_eps=1e-5,
        rope_theta=1e6, rope_scaling=None, sliding_window=None, moe=None, hf_model_type="mistral")),
    "mixtral-8x7b": (MIXTRAL_8X7B, "MixtralConfig", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_attention_heads=32,
        kv_heads=8, attention_head_dim=128, qk_norm=False, qkv_bias=False, rms_norm_eps=1e-5,
        rope_theta=1e6, rope_scaling=None, sliding_window=None,
        moe=MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=14336, norm_topk_prob=True))),
}  # fmt: skip


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_real_configs_parse_into_their_shapes(name):
    hf, config_class, expected = REAL_CONFIGS[name]
    config = from_hf_config(hf)
    assert {key: getattr(config, key) for key in expected} == expected
    # transformers' own reading of it (5.x: rope_parameters with rope_theta inside) parses the same
    assert from_hf_config(getattr(transformers, config_class)(**hf).to_dict()) == config
    with torch.device("meta"):
        names = set(ReferenceForCausalLM(config).state_dict())
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == config.qkv_bias
    assert "model.layers.0.self_attn.o_proj.bias" not in names


def test_a_sliding_window_that_would_matter_is_refused_naming_the_key_the_length_and_the_fix():
    assert from_hf_config(MISTRAL_7B_V0_1, seq_len=4096).sliding_window == 4096  # changes nothing
    with pytest.raises(HFConversionError) as raised:
        from_hf_config(MISTRAL_7B_V0_1, seq_len=8192)
    message = str(raised.value)
    assert message.startswith("sequences of 8192 tokens are longer than config.json sliding_window=4096")
    assert "(dataset.seq_len) or another backend (model.backend: hf" in message and "\n" not in message
    assert from_hf_config(MISTRAL_7B_V0_3, seq_len=32768).sliding_window is None
    assert from_hf_config(QWEN2_5_7B, seq_len=131073).sliding_window is None  # use_sliding_window: false


def test_yarn_without_factor_takes_the_ratio_of_the_lengths_as_transformers_does():
    hf = dict(TINY, model_type="qwen3", max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64})  # fmt: skip
    scaling = from_hf_config(hf).rope_scaling
    assert isinstance(scaling, YarnRopeScaling) and scaling.factor == 4.0


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_parameters\.rope_type='dynamic' is not supported by the "
         r"reference model \(supported: default, linear, llama3, yarn\); use another backend \(model\.backend: hf"),
        ({"rope_type": "llama3", "factor": 8.0}, r"rope_parameters of rope_type 'llama3' lacks "
         r"\['low_freq_factor', 'high_freq_factor'\]"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5"),
    ],
)  # fmt: skip
def test_unsupported_rope_is_one_line_naming_the_key(rope, message):
    hf = dict(TINY, model_type="llama", rope_parameters=rope)
    with pytest.raises(HFConversionError, match=message) as raised:
        from_hf_config(hf)
    assert "\n" not in str(raised.value)


def test_a_scaled_reference_config_exports_for_transformers_4_and_5(tmp_path):
    config = ReferenceModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=2,
        qk_norm=False, rope_theta=10_000.0, rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=8),
    )  # fmt: skip
    save_hf_pretrained(ReferenceForCausalLM(config), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}  # fmt: skip
    assert written["rope_parameters"] == {**written["rope_scaling"], "rope_theta": 10_000.0}
    assert read_hf_config(tmp_path) == config


def test_qkv_biases_with_qk_norm_or_experts_have_no_hf_counterpart():
    from d9d.trainer.models import to_hf_config

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=2)
    with pytest.raises(HFConversionError, match=r"model\.qkv_bias: true .* set model\.qk_norm: false"):
        to_hf_config(ReferenceModelConfig(**base, qkv_bias=True))
    moe = MoEConfig(num_experts=2, top_k=1, moe_intermediate_size=8)
    with pytest.raises(HFConversionError, match=r"model\.moe: null to export as qwen2"):
        to_hf_config(ReferenceModelConfig(**base, qkv_bias=True, qk_norm=False, moe=moe))


# ------------------------------------------------------------------------------- sliding windows


def test_a_sequence_longer_than_the_window_is_refused_by_the_forward_and_the_refusal_is_due(tmp_path):
    theirs = saved_hf_model(transformers.MistralConfig(**TINY, sliding_window=12), tmp_path)
    ours = imported(tmp_path)
    assert ours.config.sliding_window == 12
    max_logit_difference(ours, theirs, tokens(seq=12))  # window = length: every key is in it
    with pytest.raises(
        SlidingWindowError, match=r"^sequences of 13 tokens are longer than model\.sliding_window=12"
    ):
        ours(tokens(seq=13))
    unwindowed = ReferenceForCausalLM(msgspec.structs.replace(ours.config, sliding_window=None)).eval()
    unwindowed.load_state_dict(ours.state_dict())
    with pytest.raises(AssertionError):  # transformers' window drops the first key: full attention differs
        max_logit_difference(unwindowed, theirs, tokens(seq=13))


@pytest.mark.parametrize(
    ("options", "window"),
    [
        (dict(use_sliding_window=False, sliding_window=8), None),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), None),  # no layer from 2 on
        (dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), 16),  # layer 1 windowed
    ],
    ids=["off", "no-windowed-layer", "layer-1-windowed"],
)
def test_qwen2_keeps_a_window_only_where_a_layer_uses_it(tmp_path, options, window):
    """A window in some layers exports as a window in every layer: the same for every accepted sequence."""
    source, export = tmp_path / "hf", tmp_path / "export"
    theirs = saved_hf_model(transformers.Qwen2Config(**TINY, **options), source)
    ours = imported(source)
    assert ours.config.sliding_window == window
    max_logit_difference(ours, theirs, tokens())
    save_hf_pretrained(ours, export)
    assert_same_tensors(export, source)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert exported.config.sliding_window == window
    max_logit_difference(ours, exported, tokens())


def test_hf_model_type_names_mistral_or_llama_only_where_both_compute_the_model():
    from d9d.trainer.models import hf_model_type

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=2)
    assert hf_model_type(ReferenceModelConfig(**base, qk_norm=False)) == "llama"
    assert hf_model_type(ReferenceModelConfig(**base, qk_norm=False, sliding_window=8)) == "mistral"
    assert hf_model_type(ReferenceModelConfig(**base, qk_norm=False, hf_model_type="mistral")) == "mistral"
    with pytest.raises(HFConversionError, match=r"model\.hf_model_type='llama' does not compute this model .*"
                       r"mistral, with model\.sliding_window"):  # fmt: skip
        hf_model_type(ReferenceModelConfig(**base, qk_norm=False, sliding_window=8, hf_model_type="llama"))
    with pytest.raises(HFConversionError, match=r"model\.hf_model_type='mistral' .* computes a qwen3\)"):
        hf_model_type(ReferenceModelConfig(**base, hf_model_type="mistral"))


@pytest.mark.parametrize(
    ("moe", "intermediate_size", "message"),
    [
        (dict(every_n_layers=2), 24, r"experts in every layer: set model\.moe\.every_n_layers: 1"),
        (dict(norm_topk_prob=False), 24, r"renormalized to sum 1: set model\.moe\.norm_topk_prob: true"),
        ({}, 48, r"model\.intermediate_size=48 differs from model\.moe\.moe_intermediate_size=24"),
        (dict(shared_expert_intermediate_size=8), 24, r"Qwen3-MoE and Mixtral have no shared expert"),
    ],
)
def test_experts_without_qk_norm_export_as_mixtral_only_in_its_layout(moe, intermediate_size, message):
    from d9d.trainer.models import to_hf_config

    experts = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=24, **moe)
    config = ReferenceModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate_size, num_layers=2,
        num_attention_heads=2, qk_norm=False, moe=experts,
    )  # fmt: skip
    with pytest.raises(HFConversionError, match=message) as raised:
        to_hf_config(config)
    assert "\n" not in str(raised.value)
