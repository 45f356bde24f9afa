import contextlib
import json
import math

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiny_transformer import RMSNorm, TinyTransformer, make_batches, tiny_plan
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    LoraA,
    LoraB,
    LoraConfig,
    LoraError,
    apply_lora,
    cross_entropy,
    lora_detached,
    lora_disabled,
    lora_parameter_names,
    lora_parameters,
    lora_state_dict,
    loss_parallel,
    merge_lora,
    merged_state_dict,
    parallelize_fsdp,
    parallelize_tensor_parallel,
    peft_adapter_config,
    peft_key,
    peft_state_dict,
    reduce_partial_grads,
)

ATTN_MLP = LoraConfig(rank=4, alpha=8.0, target_modules=[r".*\.attn\.(q|v|o)", r".*\.mlp\.(up|down)"])
STEPS, BATCH, SEQ = 3, 8, 8


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(6, 5)
        self.k_proj = nn.Linear(6, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) + self.k_proj(x)


class _Tiny(TinyTransformer):
    """The tiny transformer with a root init hook that, like the reference model's, normal-inits every weight."""

    @torch.no_grad()
    def initialize_module(self, path: str, module: nn.Module) -> None:
        del path
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        else:
            for param in module.parameters(recurse=False):
                nn.init.normal_(param, std=0.02)


def _materialize(model: nn.Module, seed: int = 0) -> None:
    materialize = pytest.importorskip("d9d.trainer.build.materialize")
    materialize.materialize_and_initialize(model, torch.device("cpu"), seed)


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"rank": 0}, "peft.lora.rank"),
        ({"alpha": 0.0}, "peft.lora.alpha"),
        ({"dropout": 1.0}, "peft.lora.dropout"),
        ({"target_modules": []}, "peft.lora.target_modules"),
        ({"target_modules": ["ok", "(bad"]}, r"peft.lora.target_modules\[1\]"),
    ],
)
def test_config_errors_name_the_key(fields, key):
    with pytest.raises(ValueError, match=key):
        LoraConfig(**fields)
    with pytest.raises(msgspec.ValidationError, match=key):
        msgspec.convert(fields, LoraConfig)


def test_config_forbids_unknown_fields_and_is_frozen():
    with pytest.raises(msgspec.ValidationError, match="rnk"):
        msgspec.convert({"rnk": 4}, LoraConfig)
    config = msgspec.convert({"rank": 4, "alpha": 8}, LoraConfig)
    assert config.scale == 2.0
    with pytest.raises(AttributeError):
        config.rank = 2  # type: ignore[misc]


# --- one process -------------------------------------------------------------------------------


def test_apply_matches_whole_paths_freezes_the_base_and_is_a_no_op_at_init():
    torch.manual_seed(0)
    model = _Pair()
    x = torch.randn(3, 6)
    before = model(x)
    paths = apply_lora(model, LoraConfig(rank=2, target_modules=[r"q_proj"]))
    assert paths == ["q_proj"]
    assert lora_parameter_names(model) == ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    assert list(model.state_dict()) == [
        "q_proj.weight",
        "q_proj.bias",
        "q_proj.lora_A.weight",
        "q_proj.lora_B.weight",
        "k_proj.weight",
    ]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == lora_parameter_names(model)
    assert model.q_proj.lora_A.weight.shape == (2, 6) and model.q_proj.lora_B.weight.shape == (5, 2)
    assert torch.count_nonzero(model.q_proj.lora_A.weight) == 12
    assert torch.count_nonzero(model.q_proj.lora_B.weight) == 0
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert apply_lora(model, LoraConfig(rank=2, target_modules=[r"q_proj"])) == ["q_proj"]  # idempotent
    assert len(lora_parameters(model)) == 2


def test_no_match_names_the_patterns_and_the_linears():
    with pytest.raises(LoraError, match=r"q_prj.*match no nn.Linear.*q_proj, k_proj"):
        apply_lora(_Pair(), LoraConfig(target_modules=[r"q_prj"]))


def test_gradients_only_on_adapters():
    torch.manual_seed(0)
    model = _Pair()
    apply_lora(model, LoraConfig(rank=2, target_modules=[r".*_proj"]))
    model(torch.randn(3, 6)).square().sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    # B is zero at init, so only B gets a non-zero gradient in the first step; A's is exactly zero
    assert with_grad == set(lora_parameter_names(model))
    assert torch.count_nonzero(model.q_proj.lora_A.weight.grad) == 0
    assert torch.count_nonzero(model.q_proj.lora_B.weight.grad) > 0


def test_sgd_steps_equal_the_hand_written_reference():
    torch.manual_seed(0)
    model = _Pair()
    config = LoraConfig(rank=3, alpha=6.0, target_modules=["q_proj"])
    apply_lora(model, config)
    lin = model.q_proj
    w, b, k = lin.weight.detach().clone(), lin.bias.detach().clone(), model.k_proj.weight.detach().clone()
    a0 = lin.lora_A.weight.detach().clone()
    a = a0.clone().requires_grad_()
    bb = lin.lora_B.weight.detach().clone().requires_grad_()
    opt = torch.optim.SGD(lora_parameters(model), lr=0.1)
    ref_opt = torch.optim.SGD([a, bb], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        ref = x @ w.T + b + (x @ a.T @ bb.T) * config.scale + x @ k.T
        F.mse_loss(ref, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(lin.lora_A.weight, a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lin.lora_B.weight, bb, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lin.weight, w, rtol=0, atol=0)  # frozen
    assert (
        not torch.equal(lin.lora_A.weight, a0) and torch.count_nonzero(lin.lora_B.weight) > 0
    )  # both trained


def test_dropout_applies_to_the_adapter_input_only():
    torch.manual_seed(0)
    model = _Pair()
    config = LoraConfig(rank=2, dropout=0.5, target_modules=["q_proj"])
    apply_lora(model, config)
    x = torch.randn(4, 6)
    with torch.no_grad():
        base = F.linear(x, model.q_proj.weight, model.q_proj.bias) + model.k_proj(x)
        torch.testing.assert_close(model(x), base, rtol=0, atol=0)  # train mode, B = 0: base path undropped
        model.q_proj.lora_B.weight.normal_()
        model.eval()
        lin = model.q_proj
        torch.testing.assert_close(model(x), base + lin.lora_B(lin.lora_A(x)) * config.scale)
        evaluated = model(x)
        model.train()
        assert not torch.allclose(model(x), evaluated)


def test_lora_disabled_gives_the_base_model_and_puts_the_adapters_back():
    torch.manual_seed(0)
    model = _Tiny()
    tokens = make_batches(1, 2, SEQ)[0]
    base = model(tokens).detach()
    apply_lora(model, ATTN_MLP)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraB):
                module.weight.normal_(std=0.1)
    adapted = model(tokens).detach()
    assert not torch.allclose(adapted, base, atol=1e-4)  # the adapters change the output
    with lora_disabled(model):
        torch.testing.assert_close(model(tokens), base, rtol=0, atol=0)  # exactly the base model
    torch.testing.assert_close(model(tokens).detach(), adapted, rtol=0, atol=0)  # back on after the block


def test_merge_equals_the_unmerged_forward_and_leaves_the_base_state_dict():
    torch.manual_seed(0)
    model = _Tiny()
    base_keys = list(model.state_dict())
    apply_lora(model, ATTN_MLP)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraB):
                module.weight.normal_(std=0.1)
    tokens = make_batches(1, 2, SEQ)[0]
    unmerged = model(tokens)
    merged_paths = merge_lora(model)
    assert len(merged_paths) == 2 * 5
    assert list(model.state_dict()) == base_keys
    torch.testing.assert_close(model(tokens), unmerged, rtol=1e-5, atol=1e-6)


def test_memory_gradients_and_optimizer_state_only_for_adapters():
    torch.manual_seed(0)
    model = _Tiny()
    apply_lora(model, ATTN_MLP)
    adapter_bytes = sum(p.numel() * p.element_size() for p in lora_parameters(model))
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert adapter_bytes < total_bytes / 4
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-3)
    tokens = make_batches(1, 2, SEQ)[0]
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state_bytes = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for name, t in state.items()
        if name != "step"
    )
    assert grad_bytes == adapter_bytes
    assert state_bytes == 2 * adapter_bytes  # exp_avg and exp_avg_sq


# --- meta device and the trainer's materialization ------------------------------------------------


def _assert_kaiming_a_zero_b(model: nn.Module) -> None:
    adapters = [m for m in model.modules() if isinstance(m, LoraA | LoraB)]
    assert adapters
    for module in adapters:
        weight = module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight
        if isinstance(module, LoraB):
            assert torch.count_nonzero(weight) == 0
        else:
            bound = 1 / math.sqrt(weight.shape[1])  # kaiming-uniform with a=√5
            assert weight.abs().max() <= bound
            assert weight.abs().max() > 0.8 * bound  # uniform over the whole range, not normal(0.02)


def test_meta_build_materializes_a_kaiming_b_zero_through_the_root_hook():
    with torch.device("meta"):
        model = _Tiny()
    apply_lora(model, ATTN_MLP)
    assert model.blocks[0].attn.q.lora_A.weight.is_meta
    _materialize(model)
    _assert_kaiming_a_zero_b(model)
    assert model.blocks[0].attn.q.weight.std() < 0.03  # the root hook still initializes the base
    assert model.blocks[0].attn.q.lora_A.weight.requires_grad
    assert not model.blocks[0].attn.q.weight.requires_grad


def test_meta_build_materializes_through_reset_parameters():
    with torch.device("meta"):
        model = _Pair()
    apply_lora(model, LoraConfig(rank=2, target_modules=[".*_proj"]))
    _materialize(model)
    _assert_kaiming_a_zero_b(model)


# --- peft export ------------------------------------------------------------------------------------


def test_peft_names_and_adapter_config():
    torch.manual_seed(0)
    model = _Pair()
    config = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "k_.*"])
    paths = apply_lora(model, config)
    assert peft_key("q_proj.lora_A.weight") == "base_model.model.q_proj.lora_A.weight"
    assert list(peft_state_dict(model)) == [
        "base_model.model.q_proj.lora_A.weight",
        "base_model.model.q_proj.lora_B.weight",
        "base_model.model.k_proj.lora_A.weight",
        "base_model.model.k_proj.lora_B.weight",
    ]
    renamed = peft_state_dict(model, rename={"q_proj": "attn.q"})
    assert "base_model.model.attn.q.lora_A.weight" in renamed
    assert set(lora_state_dict(model)) == set(lora_parameter_names(model))
    adapter = peft_adapter_config(config, "base")
    assert adapter["r"] == 2 and adapter["lora_alpha"] == 4.0 and adapter["peft_type"] == "LORA"
    assert adapter["target_modules"] == "(?:q_proj)|(?:k_.*)"
    assert peft_adapter_config(config, "base", target_modules=paths)["target_modules"] == paths
    json.dumps(adapter)


def test_transformers_qwen3_with_our_adapters_loads_in_peft_with_equal_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    safetensors = pytest.importorskip("safetensors.torch")
    hf_config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    ours = transformers.Qwen3ForCausalLM(hf_config).eval()
    base_dir = tmp_path / "base"
    ours.save_pretrained(base_dir)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=[r".*\.(q_proj|v_proj|down_proj)"])
    paths = apply_lora(ours, config)
    assert paths[0] == "model.layers.0.self_attn.q_proj" and len(paths) == 6
    with torch.no_grad():
        for module in ours.modules():
            if isinstance(module, LoraB):
                module.weight.normal_(std=0.2)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids).logits
        base_logits = transformers.Qwen3ForCausalLM.from_pretrained(base_dir).eval()(ids).logits
    assert not torch.allclose(logits, base_logits, atol=1e-3)  # the adapters change the output

    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text(json.dumps(peft_adapter_config(config, str(base_dir))))
    safetensors.save_file(peft_state_dict(ours), adapter_dir / "adapter_model.safetensors")

    peft = pytest.importorskip("peft")
    base = transformers.Qwen3ForCausalLM.from_pretrained(base_dir)
    loaded = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-5)


# --- FSDP2 and tensor parallelism (forked ranks) ------------------------------------------------------


def _train(parallelize, config: MeshConfig | None):
    """Meta build → (tp) → LoRA → (fsdp) → materialize; 3 SGD-momentum steps on this rank's batch slice."""
    with DistributedContext.from_env(config) if config is not None else contextlib.nullcontext() as ctx:
        return _train_in(parallelize, ctx)


def _train_in(parallelize, ctx: DistributedContext | None):
    with torch.device("meta"):
        model = _Tiny()
    parallelize(model, ctx, before_lora=True)
    apply_lora(model, ATTN_MLP)
    parallelize(model, ctx, before_lora=False)
    _materialize(model, seed=0)
    params = lora_parameters(model)
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    tokens = make_batches(STEPS, BATCH, SEQ)
    dp = ctx.axis_size("dp") if ctx is not None else 1
    dp_rank = ctx.coordinate("dp") if ctx is not None else 0
    rows_per_rank = BATCH // dp
    losses = []
    for step in range(STEPS):
        rows = tokens[step, dp_rank * rows_per_rank : (dp_rank + 1) * rows_per_rank]
        with loss_parallel():
            loss = cross_entropy(model(rows[:, :-1]), rows[:, 1:], reduction="sum") / (BATCH * SEQ)
            loss.backward()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total, group=ctx.mesh("batch")["dp"].get_group())
        losses.append(float(total))
        reduce_partial_grads(params)
        opt.step()
        opt.zero_grad(set_to_none=False)

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    memory = {
        "adapter": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "state": sum(local_bytes(s["momentum_buffer"]) for s in opt.state.values()),
        "frozen_with_grad": sum(p.grad is not None for p in model.parameters() if not p.requires_grad),
        # a replicated adapter of a TP Linear gets its gradient reduced, not a Partial one (checkpointable)
        "partial": sum(
            isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements) for p in params
        ),
    }
    placements = {name: tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    merged_state = {  # the adapters folded in, on this layout (DTensor math under FSDP / TP)
        k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
        for k, v in merged_state_dict(model).items()
    }
    merge_error = None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        with torch.no_grad(), loss_parallel():
            unmerged = model(tokens[0, :2, :-1])
            merge_lora(model)
            merged = model(tokens[0, :2, :-1])
        if isinstance(merged, DTensor):
            merged, unmerged = merged.full_tensor(), unmerged.full_tensor()
        merge_error = float((merged - unmerged).abs().max())
        for name, value in model.state_dict().items():  # merge_lora leaves what merged_state_dict said
            full = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(full, merged_state[name], rtol=1e-6, atol=1e-7)
    return losses, state, memory, placements, merge_error, merged_state


def _none(model, ctx, *, before_lora):
    del model, ctx, before_lora


def _fsdp(model, ctx, *, before_lora):
    if not before_lora:
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _tp(model, ctx, *, before_lora, fsdp=False):
    if before_lora:
        parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())
    elif fsdp:
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _lora_first_then_tp_fsdp(model, ctx, *, before_lora):
    """LoRA at build time: tensor parallelism then runs with the adapters detached."""
    if not before_lora:
        with lora_detached(model):
            parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())
        parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _compare(config: MeshConfig, parallelize):
    want_losses, want_state, _, _, want_merge_error, want_merged = _train(_none, None)
    results = run_distributed(_train, config.world_size, parallelize, config)
    losses, state, _, _, merge_error, merged = results[0]
    assert want_merge_error < 1e-5
    assert merge_error is None or merge_error < 1e-5  # merge_lora on a tensor-parallel model
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    assert state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(
            state[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert merged.keys() == want_merged.keys() and not any(".lora_" in k for k in merged)
    for name, value in want_merged.items():
        torch.testing.assert_close(
            merged[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    for _, _, rank_memory, _, _, _ in results:
        assert rank_memory["grads"] == rank_memory["adapter"] == rank_memory["state"]
        assert rank_memory["frozen_with_grad"] == 0
        assert rank_memory["partial"] == 0
    return results, want_state


def test_fsdp2_matches_one_process():
    results, want_state = _compare(MeshConfig(data_parallel_shard=2), _fsdp)
    _, _, memory, placements, _, _ = results[0]
    assert placements["blocks.0.attn.q.lora_A.weight"] == (Shard(0),)
    # the adapters moved, the frozen weights did not
    assert torch.count_nonzero(want_state["blocks.0.attn.q.lora_B.weight"]) > 0
    with torch.device("meta"):
        fresh = _Tiny()
    _materialize(fresh, seed=0)
    torch.testing.assert_close(want_state["blocks.0.attn.q.weight"], fresh.blocks[0].attn.q.weight)
    # each rank holds half the adapters (even dim-0 shards here): optimizer state and grads alike
    one_process = sum(v.numel() * v.element_size() for k, v in want_state.items() if ".lora_" in k)
    assert memory["adapter"] * 2 == one_process


def test_tp2_matches_one_process_with_adapters_following_the_base_layout():
    results, _ = _compare(MeshConfig(tensor_parallel=2), _tp)
    placements = results[0][3]
    assert placements["blocks.0.attn.q.weight"] == (Shard(0),)  # column-wise
    assert placements["blocks.0.attn.q.lora_A.weight"] == (Replicate(),)
    assert placements["blocks.0.attn.q.lora_B.weight"] == (Shard(0),)
    assert placements["blocks.0.attn.o.weight"] == (Shard(1),)  # row-wise
    assert placements["blocks.0.attn.o.lora_A.weight"] == (Shard(1),)
    assert placements["blocks.0.attn.o.lora_B.weight"] == (Replicate(),)


def test_lora_first_then_tp2_x_fsdp2_4_ranks_matches_one_process():
    results, _ = _compare(MeshConfig(data_parallel_shard=2, tensor_parallel=2), _lora_first_then_tp_fsdp)
    placements = results[0][3]
    # the tp placement (FSDP adds a dim-0 shard over dp in front)
    assert placements["blocks.0.mlp.up.lora_A.weight"][1] == Replicate()
    assert placements["blocks.0.mlp.up.lora_B.weight"][1] == Shard(0)
    assert placements["blocks.0.mlp.down.lora_A.weight"][1] == Shard(1)
    assert placements["blocks.0.mlp.down.lora_B.weight"][1] == Replicate()


def test_tensor_parallel_without_detaching_fails_in_torch():
    """Why `lora_detached` exists: torch's Linear styles cannot partition a Linear with children."""

    def run():
        with DistributedContext.from_env(MeshConfig(tensor_parallel=2)) as ctx:
            model = _Tiny()
            apply_lora(model, ATTN_MLP)
            with pytest.raises(KeyError, match="parameter name"):
                parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())

    run_distributed(run, 2)


def test_lora_and_merge_after_fsdp_are_refused():
    def run():
        with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
            model = _Tiny()
            parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
            with pytest.raises(LoraError, match="before parallelize_hsdp"):
                apply_lora(model, ATTN_MLP)
            with pytest.raises(LoraError, match="FSDP-sharded"):
                merge_lora(model)

    run_distributed(run, 2)
