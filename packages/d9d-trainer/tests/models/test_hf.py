"""The reference model against Hugging Face transformers: export, import, same logits, mappers invert.

Needs the test-only `transformers` (root dev group); skipped without it. HF models are built locally
from tiny configs, nothing is downloaded.
Run with: uv run pytest packages/d9d-trainer/tests/models/test_hf.py -q
"""

import json
import os

import pytest
import torch

from d9d.ckpt import apply_mapper, save_safetensors
from d9d.trainer.models import (
    HFConversionError,
    MoEConfig,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    from_hf_config,
    hf_checkpoint_keys,
    hf_export_mapper,
    hf_import_mapper,
    hf_model_type,
    load_hf_pretrained,
    read_hf_config,
    save_hf_pretrained,
    to_hf_config,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: local folders only
transformers = pytest.importorskip("transformers")

VOCAB = 61
ATOL = 1e-5


def tiny(**overrides) -> ReferenceModelConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden / heads, so a lost head_dim would show
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    fields.update(overrides)
    return ReferenceModelConfig(**fields)


def moe(norm_topk_prob: bool = True, **layout) -> MoEConfig:
    return MoEConfig(
        num_experts=4, top_k=2, moe_intermediate_size=24, norm_topk_prob=norm_topk_prob, **layout
    )


CONFIGS = {
    "qwen3": tiny(),
    "qwen3-tied": tiny(tie_word_embeddings=True),
    "llama": tiny(qk_norm=False),
    "llama-tied-mha": tiny(qk_norm=False, num_key_value_heads=None, head_dim=None, tie_word_embeddings=True),
    "qwen3_moe": tiny(moe=moe()),
    "qwen3_moe-unnormalized-sparse": tiny(num_layers=3, moe=moe(norm_topk_prob=False, every_n_layers=2)),
    "qwen3_moe-layers": tiny(num_layers=3, moe=moe(layers=(0, 2))),
}
EXPECTED_TYPE = {name: name.split("-")[0] for name in CONFIGS}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that any mapping mistake moves the logits far beyond ATOL.

    Norm weights around 1, everything else normal(0, 0.3); routers with std 2, so no two experts'
    probabilities are close enough for rounding to change the top-k choice.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied table is visited once
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight") or name.endswith("mlp.router.gate.weight"):
                param.copy_(2.0 * noise)
            else:
                param.copy_(0.3 * noise)


def build_ours(config: ReferenceModelConfig, seed: int = 0) -> ReferenceForCausalLM:
    model = ReferenceForCausalLM(config)
    randomize_(model, seed)
    return model.eval()


def tokens(batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))


def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def our_logits(model: ReferenceForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids)


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert ours.std() > 0.5  # the comparison means something only if the logits are not near zero
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_export_loads_in_transformers_with_same_logits(name, tmp_path):
    config = CONFIGS[name]
    ours = build_ours(config)
    save_hf_pretrained(ours, tmp_path)
    hf_config = json.loads((tmp_path / "config.json").read_text())
    assert hf_config["model_type"] == EXPECTED_TYPE[name]

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == hf_config["architectures"][0]
    assert theirs.dtype == torch.float32
    # everything transformers holds came from the folder: same tensors as ours, key for key
    exported = apply_mapper(hf_export_mapper(config), ours.state_dict())
    for key, value in exported.items():
        torch.testing.assert_close(_hf_tensor(theirs, key), value, atol=0, rtol=0)
    input_ids = tokens()
    assert_same_logits(our_logits(ours, input_ids), hf_logits(theirs, input_ids))


def _hf_tensor(model, key: str) -> torch.Tensor:
    """A tensor of a transformers model by its checkpoint key (MoE experts are fused in memory in v5)."""
    state = model.state_dict()
    if key in state:
        return state[key]
    prefix, expert, proj, _ = key.rsplit(".", 3)  # "model.layers.1.mlp.experts", "2", "gate_proj", "weight"
    j = int(expert)
    if proj == "down_proj":
        return state[f"{prefix}.down_proj"][j]
    gate, up = state[f"{prefix}.gate_up_proj"][j].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


def _hf_model(config: ReferenceModelConfig, seed: int):
    """A transformers model of the same architecture, built from a config (no download), randomized."""
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(config))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    randomize_(model, seed)
    return model.eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_checkpoint_loads_into_ours_with_same_logits(name, tmp_path):
    config = CONFIGS[name]
    theirs = _hf_model(config, seed=1)
    theirs.save_pretrained(tmp_path)
    assert hf_checkpoint_keys(tmp_path) == sorted(hf_export_mapper(config).outputs)

    loaded_config = read_hf_config(tmp_path, max_position_embeddings=config.max_position_embeddings)
    assert loaded_config == config
    with torch.device("meta"):
        ours = ReferenceForCausalLM(loaded_config)
    ours.to_empty(device="cpu")
    ours.init_weights()  # RoPE buffers and tying; every parameter is then overwritten
    load_hf_pretrained(ours, tmp_path)
    if config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    input_ids = tokens()
    assert_same_logits(our_logits(ours.eval(), input_ids), hf_logits(theirs, input_ids))


@pytest.mark.parametrize("name", ["qwen3-tied", "llama-tied-mha"])
def test_tied_folder_storing_both_copies_loads(name, tmp_path):
    """Some tied checkpoints store `lm_head.weight` too; transformers ignores it, and so do we."""
    config = CONFIGS[name]
    source = build_ours(config, seed=3)
    save_safetensors(source, tmp_path)  # our names are HF's: both keys, one table
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(config)))
    assert "lm_head.weight" in hf_checkpoint_keys(tmp_path)

    target = build_ours(config, seed=4)
    load_hf_pretrained(target, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = tokens()
    assert_same_logits(our_logits(target, input_ids), our_logits(source, input_ids))
    assert_same_logits(our_logits(target, input_ids), hf_logits(theirs, input_ids))


@pytest.mark.parametrize("name", CONFIGS)
def test_map_then_inverse_is_identity(name):
    config = CONFIGS[name]
    state = build_ours(config, seed=5).state_dict()
    exported = apply_mapper(hf_export_mapper(config), state)
    back = apply_mapper(hf_import_mapper(config), exported)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    if config.tie_word_embeddings:
        assert "lm_head.weight" not in exported


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_config_round_trip(name):
    config = CONFIGS[name]
    hf = to_hf_config(config)
    assert hf_model_type(config) == hf["model_type"] == EXPECTED_TYPE[name]
    assert from_hf_config(hf) == config
    parsed = transformers.AutoConfig.for_model(**hf)  # what transformers reads from it
    assert parsed.head_dim == config.attention_head_dim
    assert parsed.num_key_value_heads == config.kv_heads
    assert parsed.tie_word_embeddings == config.tie_word_embeddings
    assert from_hf_config(parsed.to_dict()) == config


def test_from_hf_config_uses_transformers_defaults_for_missing_keys():
    minimal = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=1)
    for model_type in ("qwen3", "llama"):
        hf = dict(minimal, model_type=model_type, num_attention_heads=32)  # Qwen3's default kv heads: 32
        ours = from_hf_config(hf)
        parsed = transformers.AutoConfig.for_model(**hf)
        assert ours.attention_head_dim == parsed.head_dim
        assert ours.kv_heads == parsed.num_key_value_heads
        rope = getattr(parsed, "rope_parameters", None) or {"rope_theta": parsed.rope_theta}  # 5.x / 4.x
        assert ours.rope_theta == rope["rope_theta"]
    hf = dict(
        minimal,
        model_type="qwen3_moe",
        num_attention_heads=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    ours = from_hf_config(hf)
    parsed = transformers.AutoConfig.for_model(**hf)
    assert ours.moe is not None and ours.moe.norm_topk_prob == parsed.norm_topk_prob
    assert ours.kv_heads == parsed.num_key_value_heads


def test_unsupported_configs_are_clear_errors(tmp_path):
    with pytest.raises(HFConversionError, match="shared_expert"):
        to_hf_config(
            tiny(
                moe=MoEConfig(
                    num_experts=4, top_k=2, moe_intermediate_size=8, shared_expert_intermediate_size=16
                )
            )
        )
    with pytest.raises(HFConversionError, match="qk_norm"):
        hf_export_mapper(tiny(qk_norm=False, moe=moe()))
    llama3 = to_hf_config(tiny(qk_norm=False)) | {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}
    }
    with pytest.raises(HFConversionError, match="llama3"):
        from_hf_config(llama3)
    with pytest.raises(HFConversionError, match="attention_bias"):
        from_hf_config(to_hf_config(tiny()) | {"attention_bias": True})
    with pytest.raises(HFConversionError, match="mistral"):
        from_hf_config({"model_type": "mistral"})

    save_hf_pretrained(build_ours(tiny()), tmp_path)
    with pytest.raises(HFConversionError, match="rope_theta"):
        load_hf_pretrained(build_ours(tiny(rope_theta=500.0)), tmp_path)
