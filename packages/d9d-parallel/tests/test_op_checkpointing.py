"""Per-op activation checkpointing (`mode: op`): what its policy keeps, the same numbers as no
checkpointing (one process, FSDP 2, TP 2), the bytes a block keeps (between full and none: the block's
inputs plus its matmul and attention outputs, counted from their shapes), and what backward recomputes
(the cheap ops, no matmul, no attention, no collective), eagerly and compiled."""

import collections
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import TinyConfig, make_batches, make_model, rotary_table, tiny_plan
from _train_compare import BATCH, SEQ, STEPS, assert_same_run, parallel_run, reference_run
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ActivationCheckpointingConfig,
    ParallelizeError,
    apply_activation_checkpointing,
    op_checkpoint_policy,
    parallelize_fsdp,
    saved_activation_bytes,
)

CFG = TinyConfig(n_layers=2)
MODES = ("none", "full", "op")
aten = torch.ops.aten


def _ac(mode: str) -> ActivationCheckpointingConfig:
    return ActivationCheckpointingConfig(mode=mode)  # type: ignore[arg-type]


# --- the policy ---------------------------------------------------------------------------------

_KEPT = [
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional.wait_tensor.default,
]
_RECOMPUTED = [
    aten.silu.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.rsqrt.default,
    aten.pow.Tensor_Scalar,
    aten.mean.dim,
    aten.neg.default,
    aten.cat.default,
    aten._to_copy.default,
    aten._softmax.default,
    aten.view.default,
    aten.transpose.int,
]


@pytest.mark.parametrize("op", _KEPT, ids=str)
def test_the_policy_keeps_matmul_attention_and_collective_outputs(op):
    assert op_checkpoint_policy(None, op) is CheckpointPolicy.MUST_SAVE


def test_the_policy_keeps_the_grouped_matmul_of_moe_where_torch_has_it():
    if not hasattr(aten, "_grouped_mm"):
        pytest.skip("this torch has no grouped matmul")
    assert op_checkpoint_policy(None, aten._grouped_mm.default) is CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("op", _RECOMPUTED, ids=str)
def test_the_policy_recomputes_the_cheap_ops(op):
    assert op_checkpoint_policy(None, op) is CheckpointPolicy.PREFER_RECOMPUTE


def test_op_mode_checkpoints_every_block_once_and_refuses_a_second_kind():
    model = make_model(cfg=TinyConfig(n_layers=3))
    assert apply_activation_checkpointing(model.blocks, _ac("op")) == list(model.blocks)
    assert apply_activation_checkpointing(model.blocks, _ac("op")) == list(model.blocks)  # idempotent
    with pytest.raises(ParallelizeError, match=r"block 0 is already checkpointed per op; checkpoint a block"):
        apply_activation_checkpointing(model.blocks, _ac("full"))
    whole = make_model(cfg=CFG)
    apply_activation_checkpointing(whole.blocks, _ac("selective"))
    with pytest.raises(ParallelizeError, match=r"block 0 is already checkpointed whole"):
        apply_activation_checkpointing(whole.blocks, _ac("op"))


# --- the same numbers, one process --------------------------------------------------------------


def _train(mode: str, steps: int = STEPS) -> dict[str, Any]:
    """AdamW steps of the tiny model with `mode`: every loss, every step's gradients, the final weights."""
    model = make_model(cfg=CFG)
    apply_activation_checkpointing(model.blocks, _ac(mode))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = make_batches(steps, BATCH, SEQ)
    losses, grads = [], []
    for step in range(steps):
        loss = F.cross_entropy(model(tokens[step, :, :-1]).flatten(0, 1), tokens[step, :, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "weights": copy.deepcopy(model.state_dict())}


def test_op_checkpointing_gives_the_numbers_of_none_and_full_bit_for_bit():
    runs = {mode: _train(mode) for mode in MODES}
    want = runs["none"]
    for mode in ("op", "full"):
        got = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(got["losses"], want["losses"], strict=True)), mode
        for step, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
            assert all(torch.equal(g[n], w[n]) for n in w), (mode, step)
        assert all(torch.equal(got["weights"][k], v) for k, v in want["weights"].items()), mode
    assert not torch.equal(want["losses"][0], want["losses"][-1])  # it trained


# --- what a block keeps, and what backward recomputes --------------------------------------------


def _one_block(mode: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    block = make_model(cfg=CFG).blocks[0]
    apply_activation_checkpointing([block], _ac(mode))
    x = torch.randn(BATCH, SEQ, CFG.dim, requires_grad=True)
    return block, x, rotary_table(SEQ, CFG.dim // CFG.n_heads, x.device)


def _block_saved_bytes(mode: str) -> int:
    block, x, rope = _one_block(mode)
    return saved_activation_bytes(lambda: block(x, rope), exclude=block.parameters())


def test_a_block_keeps_its_inputs_and_its_matmul_and_attention_outputs():
    saved = {mode: _block_saved_bytes(mode) for mode in MODES}
    tokens, fp32, head_dim = BATCH * SEQ, 4, CFG.dim // CFG.n_heads
    inputs = tokens * CFG.dim * fp32 + 2 * SEQ * (head_dim // 2) * fp32  # x, and the rope table
    matmuls = tokens * fp32 * (4 * CFG.dim + 2 * CFG.hidden + CFG.dim)  # q k v o, gate up, down
    attention = tokens * CFG.dim * fp32 + BATCH * CFG.n_heads * SEQ * fp32  # output, log-sum-exp
    assert saved["full"] == inputs
    assert saved["op"] == inputs + matmuls + attention
    assert saved["full"] < saved["op"] < saved["none"], saved


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> collections.Counter[str]:
    block, x, rope = _one_block(mode)
    out = block(x, rope)
    with _CountOps() as counted:
        out.sum().backward()
    return counted.counts


def test_backward_recomputes_no_matmul_and_no_attention_with_op_but_the_cheap_ops():
    ops = {mode: _backward_ops(mode) for mode in MODES}
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    # backward's own: two matmuls per linear (7 linears), attention's backward kernel
    assert ops["none"]["mm"] == 14 and ops["none"][sdpa] == 0
    # full: the forward again, up to the last tensor backward needs (down's input: torch's early stop
    # skips the down projection itself)
    assert ops["full"]["mm"] == 14 + 6 and ops["full"][sdpa] == 1
    assert ops["op"]["mm"] == 14 and ops["op"][sdpa] == 0
    for cheap in ("silu", "rsqrt", "mean", "stack", "sub"):  # the MLP's activation, norms, RoPE
        assert ops["none"][cheap] == 0, cheap
        assert ops["op"][cheap] == ops["full"][cheap] > 0, cheap


# --- FSDP 2 and TP 2 (forked ranks) -------------------------------------------------------------


def _fsdp(model: torch.nn.Module, ctx: Any, *, mode: str) -> None:
    apply_activation_checkpointing(model.blocks, _ac(mode))
    parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), reshard_after_forward=True)


def _fsdp_runs() -> dict[str, Any]:
    config = MeshConfig(data_parallel_shard=2)
    return {mode: parallel_run(config, lambda m, c, mode=mode: _fsdp(m, c, mode=mode)) for mode in MODES}


def test_fsdp2_with_op_checkpointing_equals_none_and_full_bit_for_bit_and_one_process():
    runs = run_distributed(_fsdp_runs, 2, timeout=120)[0]
    want = runs["none"]
    for mode in ("op", "full"):
        got = runs[mode]
        assert got.losses == want.losses and got.grad_norms == want.grad_norms, mode
        assert all(torch.equal(got.params[k], v) for k, v in want.params.items()), mode
    assert_same_run(runs["op"], reference_run(), rtol=1e-4, atol=1e-5)


def _tp_backward(mode: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    from d9d.mesh import DistributedContext
    from d9d.parallel import cross_entropy, loss_parallel, parallelize_tensor_parallel

    class Collectives(_CountOps):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace == "_c10d_functional" and "wait" not in str(func):
                self.counts[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    with DistributedContext.from_env(MeshConfig(tensor_parallel=2)) as ctx:
        model = make_model(cfg=CFG)
        apply_activation_checkpointing(model.blocks, _ac(mode))
        parallelize_tensor_parallel(model, ctx.mesh("dense"), tiny_plan())
        tokens = make_batches(1, BATCH, SEQ)[0]
        with loss_parallel():
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], reduction="sum")
            with Collectives() as counted:
                loss.backward()
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters()
        }
        return {"collectives": counted.counts, "grads": grads}


def _tp_runs() -> dict[str, Any]:
    return {mode: _tp_backward(mode) for mode in MODES}


def test_tp2_op_checkpointing_repeats_no_collective_in_backward_and_keeps_the_gradients():
    runs = run_distributed(_tp_runs, 2, timeout=120)[0]
    none, full, op = (runs[m]["collectives"] for m in MODES)
    assert op == none  # the backward's own gathers and reductions only
    # full gathers the sequence-parallel input of every attention and MLP again, and reduce-scatters
    # their outputs again
    assert full["all_gather_into_tensor"] > none["all_gather_into_tensor"], (full, none)
    assert full["reduce_scatter_tensor"] > none["reduce_scatter_tensor"], (full, none)
    for mode in ("op", "full"):
        assert all(torch.equal(runs[mode]["grads"][n], g) for n, g in runs["none"]["grads"].items()), mode


# --- compiled (in one forked process: no inductor pool in the pytest process) --------------------


def _compiled_checks() -> dict[str, Any]:
    """Each mode's compiled backward graph (its ops by name), and the tiny model trained with `op`,
    eagerly and compiled per block by inductor: losses, graphs, graph breaks."""
    import torch._inductor.config
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    from d9d.parallel import CompileConfig, compile_blocks

    torch._inductor.config.compile_threads = 1
    seen: dict[str, Any] = {"backward_graph": {}, "trained": {}}
    for mode in MODES:

        def count_backward(gm: torch.fx.GraphModule, _: Any, mode: str = mode) -> Any:
            targets = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            seen["backward_graph"][mode] = targets
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        block, x, rope = _one_block(mode)
        forward = aot_autograd(
            fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=count_backward
        )
        block.compile(backend=forward)
        block(x, rope).sum().backward()
    for mode, compiled in [("op", False), ("op", True)]:
        torch._dynamo.reset()
        counters.clear()
        model = make_model(cfg=CFG)
        apply_activation_checkpointing(model.blocks, _ac(mode))
        compile_blocks(model.blocks, CompileConfig(enabled=compiled))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens, losses = make_batches(STEPS, BATCH, SEQ), []
        for step in range(STEPS):
            loss = F.cross_entropy(model(tokens[step, :, :-1]).flatten(0, 1), tokens[step, :, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        breaks = sum(counters["graph_break"].values())
        seen["trained"][mode, compiled] = (losses, int(counters["stats"]["unique_graphs"]), breaks)
    return seen


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    (found,) = run_distributed(_compiled_checks, 1, timeout=300)
    return found


def test_compiled_op_checkpointing_recomputes_no_matmul_and_no_attention(compiled):
    graphs = compiled["backward_graph"]
    mm, sdpa = "aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert graphs["none"][mm] == graphs["op"][mm] == 14  # backward's own
    assert graphs["full"][mm] > 14  # (where attention's output goes under full differs by torch version)
    assert graphs["op"][sdpa] == graphs["none"][sdpa] == 0
    for cheap in ("aten.silu.default", "aten.rsqrt.default"):  # recomputed in the compiled backward too
        assert graphs["op"][cheap] == graphs["full"][cheap] > graphs["none"][cheap] == 0, cheap


def test_compiled_op_checkpointing_keeps_one_graph_per_block_and_the_eager_numbers(compiled):
    trained = compiled["trained"]
    eager, _, _ = trained["op", False]
    losses, graphs, breaks = trained["op", True]
    assert (graphs, breaks) == (1, 0)  # 2 blocks of one shape: one graph, as full checkpointing gives
    assert losses == pytest.approx(eager, rel=1e-5)  # inductor's rounding
    assert eager[0] != eager[-1]
