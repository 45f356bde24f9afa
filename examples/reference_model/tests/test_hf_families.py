"""Hugging Face families beyond qwen3/llama/qwen3_moe: scaled RoPE, q/k/v biases (Qwen2), Mistral, Mixtral.

Each family starts on transformers' side: a tiny random model built from transformers' own config
class and saved with `save_pretrained` (no download). Import gives transformers' logits (fp32,
atol 1e-5); export gives back every safetensors tensor bit for bit and a config.json that
transformers reads to the same values that matter. Real checkpoints' config.json fields (written
out below from their public files) parse into the right shapes, or are refused with the reason.
Run with: uv run pytest examples/reference_model/tests/test_hf_families.py -q
"""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # examples/, so `reference_model` imports

from reference_model import (
    HFConversionError,
    Llama3RopeScaling,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    YarnRopeScaling,
    from_hf_config,
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
    if ours.config.rope_scaling is not None:  # the test sequences see the scaling: plain RoPE is off
        plain = ReferenceForCausalLM(msgspec.structs.replace(ours.config, rope_scaling=None)).eval()
        plain.load_state_dict(ours.state_dict())
        with pytest.raises(AssertionError):
            max_logit_difference(plain, theirs, tokens())

    save_hf_pretrained(ours, export)
    assert_same_tensors(export, source)
    assert what_matters(export) == what_matters(source)
    assert read_hf_config(export) == read_hf_config(source)


# ----------------------------------------------------------------------------------- real configs

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip


def test_llama_3_1_8b_config_parses_into_its_shapes():
    config = from_hf_config(LLAMA_3_1_8B)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        128256, 4096, 14336, 32,
    )  # fmt: skip
    assert (config.num_attention_heads, config.kv_heads, config.attention_head_dim) == (32, 8, 128)
    assert not config.qk_norm and config.moe is None and config.rms_norm_eps == 1e-5
    assert config.rope_theta == 500_000.0
    assert config.rope_scaling == Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    # transformers 5 writes the same config with rope_parameters (rope_theta inside)
    v5 = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA_3_1_8B["rope_scaling"], "rope_theta": 500000.0}
    assert from_hf_config(v5) == config
    assert from_hf_config(transformers.LlamaConfig(**LLAMA_3_1_8B).to_dict()) == config


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


QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip


def test_qwen2_5_7b_config_parses_into_its_shapes():
    config = from_hf_config(QWEN2_5_7B)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        152064, 3584, 18944, 28,
    )  # fmt: skip
    assert (config.num_attention_heads, config.kv_heads, config.attention_head_dim) == (28, 4, 128)
    assert config.qkv_bias and not config.qk_norm and config.moe is None
    assert config.rope_theta == 1e6 and config.rope_scaling is None and config.rms_norm_eps == 1e-6
    assert from_hf_config(transformers.Qwen2Config(**QWEN2_5_7B).to_dict()) == config
    with torch.device("meta"):
        names = set(ReferenceForCausalLM(config).state_dict())
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.27.self_attn.v_proj.bias"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


def test_qkv_biases_with_qk_norm_or_experts_have_no_hf_counterpart():
    from reference_model import MoEConfig, to_hf_config

    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=2)
    with pytest.raises(HFConversionError, match=r"model\.qkv_bias: true .* set model\.qk_norm: false"):
        to_hf_config(ReferenceModelConfig(**base, qkv_bias=True))
    moe = MoEConfig(num_experts=2, top_k=1, moe_intermediate_size=8)
    with pytest.raises(HFConversionError, match=r"model\.moe: null to export as qwen2"):
        to_hf_config(ReferenceModelConfig(**base, qkv_bias=True, qk_norm=False, moe=moe))
