"""Tests of the reference model: shapes, causality, GQA, tying, meta-device init, config errors, overfitting.

Run with: uv run pytest packages/d9d-trainer/tests/models -q
"""

import sys

import msgspec
import pytest
import torch
import torch.nn.functional as F

from d9d.trainer.models import (
    MoEConfig,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    ReferenceModelConfigError,
    apply_rotary,
)

VOCAB = 97


def tiny(**overrides) -> ReferenceModelConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10_000.0,
        max_position_embeddings=64,
    )
    fields.update(overrides)
    return ReferenceModelConfig(**fields)


def build(config: ReferenceModelConfig, seed: int = 0) -> ReferenceForCausalLM:
    torch.manual_seed(seed)
    return ReferenceForCausalLM(config)


def tokens(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_logits_shape_and_dtype(qk_norm, tie):
    model = build(tiny(qk_norm=qk_norm, tie_word_embeddings=tie))
    logits = model(tokens(3, 7))
    assert logits.shape == (3, 7, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_fp32_logits_from_bf16_model():
    model = build(tiny(fp32_logits=True)).to(torch.bfloat16)
    logits = model(tokens())
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_hf_module_names():
    names = set(build(tiny(num_layers=1)).state_dict())
    prefix = "model.layers.0."
    expected = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        prefix + "input_layernorm.weight",
        prefix + "post_attention_layernorm.weight",
        *(
            prefix + f"self_attn.{p}.weight"
            for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ),
        *(prefix + f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
    }
    assert names == expected  # RoPE buffers are not persistent


def test_causal():
    model = build(tiny()).eval()
    ids = tokens(2, 10)
    changed = ids.clone()
    t = 6
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_position_ids_default_and_shift():
    model = build(tiny()).eval()
    ids = tokens(2, 8)
    with torch.no_grad():
        default = model(ids)
        explicit = model(ids, torch.arange(8).expand(2, 8))
        shifted = model(ids, torch.arange(8) + 5)
    torch.testing.assert_close(default, explicit)
    # RoPE depends on relative positions only: a constant shift leaves the logits unchanged.
    torch.testing.assert_close(default, shifted, atol=1e-4, rtol=1e-4)


def test_rotary_is_half_split_rotation():
    x = torch.randn(1, 1, 3, 4)
    angle = torch.tensor([0.0, 0.3, 1.1])
    cos = torch.stack([angle.cos(), angle.cos()] * 2, dim=-1).unsqueeze(0)
    sin = torch.stack([angle.sin(), angle.sin()] * 2, dim=-1).unsqueeze(0)
    out = apply_rotary(x, cos, sin)
    c, s = angle.cos().view(1, 1, 3), angle.sin().view(1, 1, 3)
    for i in range(2):  # channel i pairs with channel i + 2
        a, b = x[..., i], x[..., i + 2]
        torch.testing.assert_close(out[..., i], a * c - b * s)
        torch.testing.assert_close(out[..., i + 2], b * c + a * s)


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa = build(tiny(num_attention_heads=4, num_key_value_heads=2)).eval()
    mha = build(tiny(num_attention_heads=4, num_key_value_heads=4)).eval()
    head_dim, group = gqa.config.attention_head_dim, 2
    state = {}
    for name, value in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # rows are grouped per kv head; query head h uses kv head h // group.
            value = value.view(-1, head_dim, value.shape[-1]).repeat_interleave(group, dim=0).flatten(0, 1)
        state[name] = value
    mha.load_state_dict(state)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids))


def test_tied_embeddings_share_storage():
    model = build(tiny(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(list(model.parameters())) == len(set(model.state_dict())) - 1


def test_untied_embeddings_are_separate():
    model = build(tiny(tie_word_embeddings=False))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("tie", [True, False])
def test_meta_build_to_empty_init_matches_cpu_build(tie):
    config = tiny(tie_word_embeddings=tie)
    with torch.device("meta"):
        meta_model = ReferenceForCausalLM(config)
    assert all(p.is_meta for p in meta_model.parameters())
    meta_model.to_empty(device="cpu")
    torch.manual_seed(123)
    meta_model.init_weights()

    cpu_model = ReferenceForCausalLM(config)
    torch.manual_seed(123)
    cpu_model.init_weights()

    if tie:
        assert meta_model.lm_head.weight is meta_model.model.embed_tokens.weight
    meta_state, cpu_state = meta_model.state_dict(), cpu_model.state_dict()
    assert meta_state.keys() == cpu_state.keys()
    for name in cpu_state:
        torch.testing.assert_close(meta_state[name], cpu_state[name], rtol=0, atol=0, msg=name)
    for (name, meta_buf), (_, cpu_buf) in zip(
        meta_model.named_buffers(), cpu_model.named_buffers(), strict=True
    ):
        torch.testing.assert_close(meta_buf, cpu_buf, rtol=0, atol=0, msg=name)
    ids = tokens()
    with torch.no_grad():
        logits = meta_model(ids)
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, cpu_model(ids), rtol=0, atol=0)


def test_init_statistics():
    model = build(tiny(hidden_size=64, intermediate_size=256, vocab_size=VOCAB))
    weight = model.model.layers["0"].mlp.up_proj.weight
    assert abs(weight.std().item() - 0.02) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert torch.equal(
        model.model.layers["1"].self_attn.q_norm.weight, torch.ones(model.config.attention_head_dim)
    )


def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    config = tiny(
        hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = ReferenceForCausalLM(config)
    ids = tokens(4, 16, seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 4.0  # about ln(97) at init
    assert losses[-1] < 0.3 * losses[0], losses


def test_layers_keyed_by_index_allow_stage_split():
    config = tiny(num_layers=4)
    model = build(config).eval()
    ids = tokens()
    with torch.no_grad():
        full = model(ids)
        # Two pipeline-style stages built from copies of the same weights.
        first, second = build(config), build(config)
        for stage in (first, second):
            stage.load_state_dict(model.state_dict())
        del first.model.layers["2"], first.model.layers["3"]
        first.model.norm, first.lm_head = None, None
        del second.model.layers["0"], second.model.layers["1"]
        second.model.embed_tokens = None
        assert {k for k in second.state_dict() if "layers" in k} <= {
            k for k in model.state_dict() if k.startswith(("model.layers.2.", "model.layers.3."))
        }
        torch.testing.assert_close(second(first(ids)), full)


# --- config --------------------------------------------------------------------------------------


def test_config_defaults():
    config = ReferenceModelConfig(
        vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=8
    )
    assert config.kv_heads == 8
    assert config.attention_head_dim == 8
    assert config.moe is None
    assert not config.is_moe_layer(0)
    assert config.flops_per_token(16) > 0


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 30}, "head_dim"),
        ({"head_dim": 5}, "head_dim"),
        ({"num_layers": 0}, "num_layers"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"moe": MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=8, layers=(0, 7))}, "moe.layers"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ReferenceModelConfigError, match=rf"model\.{key}"):
        tiny(**overrides)


@pytest.mark.parametrize(
    ("moe", "key"),
    [
        ({"num_experts": 2, "top_k": 3, "moe_intermediate_size": 8}, "moe.top_k"),
        (
            {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 8, "layers": [0], "every_n_layers": 2},
            "moe.layers",
        ),
        ({"num_experts": 4, "top_k": 2, "moe_intermediate_size": 0}, "moe.moe_intermediate_size"),
    ],
)
def test_moe_config_errors_name_the_key(moe, key):
    data = msgspec.to_builtins(tiny())
    data["moe"] = moe
    with pytest.raises(msgspec.ValidationError, match=rf"model\.{key}.*at `\$\.moe`"):
        ReferenceModelConfig.from_dict(data)


def test_config_from_dict_rejects_unknown_and_mistyped_keys():
    data = msgspec.to_builtins(tiny())
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `num_hidden_layer`"):
        ReferenceModelConfig.from_dict({**data, "num_hidden_layer": 2})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.hidden_size"):
        ReferenceModelConfig.from_dict({**data, "hidden_size": "big"})
    assert ReferenceModelConfig.from_dict(data) == tiny()


def test_moe_layer_selection():
    every_second = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=8, every_n_layers=2)
    assert [every_second.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    explicit = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=8, layers=(0, 2))
    assert [explicit.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


# --- MoE -----------------------------------------------------------------------------------------


def _moe_class():
    try:
        from d9d.parallel.expert import MoE
    except ImportError:
        return None
    return MoE


@pytest.mark.skipif(_moe_class() is None, reason="d9d.parallel's MoE is not importable")
def test_moe_layers_forward_and_meta_init():
    moe = MoEConfig(
        num_experts=4, top_k=2, moe_intermediate_size=16, every_n_layers=2, shared_expert_intermediate_size=16
    )
    config = tiny(num_layers=4, moe=moe)
    model = build(config)
    moe_cls = _moe_class()
    assert [isinstance(model.model.layers[str(i)].mlp, moe_cls) for i in range(4)] == [
        False,
        True,
        False,
        True,
    ]
    assert torch.isfinite(model(tokens())).all()

    with torch.device("meta"):
        meta_model = ReferenceForCausalLM(config)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(0)
    meta_model.init_weights()
    torch.manual_seed(0)
    model.init_weights()
    for (name, a), (_, b) in zip(meta_model.state_dict().items(), model.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert abs(model.model.layers["1"].mlp.experts.w_up.std().item() - 0.02) < 0.005


def test_moe_without_d9d_parallel_is_not_implemented(monkeypatch):
    monkeypatch.setitem(sys.modules, "d9d.parallel.expert", None)  # makes the import fail
    config = tiny(moe=MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=16))
    with pytest.raises(NotImplementedError, match=r"model\.moe needs the MoE layer of d9d\.parallel"):
        ReferenceForCausalLM(config)


# --- q/k/v biases (Qwen2) ------------------------------------------------------------------------


def test_qkv_biases_start_at_zero_and_build_alike_on_meta():
    config = tiny(qkv_bias=True, qk_norm=False)
    with torch.device("meta"):
        meta_model = ReferenceForCausalLM(config)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(3)
    meta_model.init_weights()
    cpu_model = ReferenceForCausalLM(config)
    torch.manual_seed(3)
    cpu_model.init_weights()
    biases = {k: v for k, v in cpu_model.state_dict().items() if k.endswith(".bias")}
    assert sorted(biases) == sorted(
        f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in ("q", "k", "v")
    )
    assert all(torch.equal(v, torch.zeros_like(v)) for v in biases.values())
    for name, value in cpu_model.state_dict().items():
        assert torch.equal(meta_model.state_dict()[name], value), name
    # the weights draw what they drew without biases: the same seed gives the same weights
    unbiased = ReferenceForCausalLM(tiny(qk_norm=False))
    torch.manual_seed(3)
    unbiased.init_weights()
    for name, value in unbiased.state_dict().items():
        assert torch.equal(cpu_model.state_dict()[name], value), name
    attention = cpu_model.model.layers["0"].self_attn
    cpu_model.initialize_module("model.layers.0.self_attn.q_proj", attention.q_proj)
    assert torch.equal(attention.q_proj.bias, torch.zeros_like(attention.q_proj.bias))


def _sdpa_calls(model: ReferenceForCausalLM, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, int]:
    """The logits (no grad: FlexAttention has no CPU backward) and how many SDPA calls made them."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(ids, **kwargs)
    return logits, sum(e.name == "aten::scaled_dot_product_attention" for e in prof.events())


@pytest.mark.parametrize("packed", [False, True])
def test_flex_attention_backend_gives_the_sdpa_logits(packed):
    # trainer.attention.backend: flex sets `attention_backend` (d9d.parallel.apply_attention_kernel);
    # causal rows then run FlexAttention with a one-document mask, packed rows their document mask
    model = build(tiny())
    ids = tokens(2, 16)
    kwargs = {"document_ids": torch.tensor([[0] * 5 + [1] * 11, [2] * 9 + [3] * 7])} if packed else {}
    want, sdpa = _sdpa_calls(model, ids, **kwargs)
    assert sdpa == model.config.num_layers
    for backend, calls in (("flex", 0), ("sdpa", model.config.num_layers)):
        model.model.attention_backend = backend
        got, sdpa = _sdpa_calls(model, ids, **kwargs)
        assert sdpa == calls, (backend, sdpa)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_the_document_mask_is_built_once_per_batch_for_every_layer(monkeypatch, backend):
    """Packed rows: one mask per batch (and window), shared by every layer, never one per layer: the
    FlexAttention block mask on CUDA is as costly as a layer's attention to build."""
    from d9d.parallel import DocumentMask

    builds, real = [], DocumentMask._build

    def counted(mask: DocumentMask, window: int | None) -> object:
        builds.append(window)
        return real(mask, window)

    monkeypatch.setattr(DocumentMask, "_build", counted)
    model = build(tiny(num_layers=3))
    model.model.attention_backend = backend
    ids = tokens(2, 16)
    with torch.no_grad():
        for layout in ([[0] * 5 + [1] * 11, [2] * 9 + [3] * 7], [[0] * 8 + [1] * 8, [2] * 16]):
            model(ids, document_ids=torch.tensor(layout))
    assert builds == [None, None], builds  # two batches, three layers each
