"""The fused LM head + cross-entropy: the unfused loss's numbers (float32, one process and vocab-parallel
over 2 forked tp ranks), and no [tokens, vocab] tensor ever made (counted by a dispatch mode over every
op of forward and backward, and by saved-tensor hooks)."""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    LinearCrossEntropyHead,
    ParallelizeError,
    apply_lora,
    fuse_linear_cross_entropy,
    fused_head_problem,
    linear_cross_entropy,
    set_head_reduction,
)
from d9d.parallel.config import LoraConfig

TOKENS, HIDDEN, VOCAB = (3, 29), 16, 53  # 87 tokens: chunks of 10 leave a chunk of 7
CHUNK = 10
#: Measured (torch 2.15, CPU, float32; chunks of 1, 7, 10 and 86 tokens, with a bias, soft-capped): the
#: loss within 1.9e-7 of the unfused one relative, the gradients within 4e-7 of each one's largest entry.
REL = 1e-6


def _inputs(bias: bool = False, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, VOCAB, TOKENS, generator=g)
    labels[0, :6] = -100  # a prompt and padding add nothing
    labels[2, -4:] = -100
    return {
        "hidden": torch.randn(*TOKENS, HIDDEN, generator=g).requires_grad_(),
        "weight": torch.randn(VOCAB, HIDDEN, generator=g).requires_grad_(),
        "bias": torch.randn(VOCAB, generator=g).requires_grad_() if bias else None,
        "labels": labels,
    }


def _unfused(hidden, weight, labels, bias=None, softcap=None) -> torch.Tensor:
    """Today's loss: full logits, upcast, summed cross-entropy."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def _loss_and_grads(loss_fn, inputs: dict[str, Any], **options: Any) -> tuple[float, list[torch.Tensor]]:
    leaves = [t for t in (inputs["hidden"], inputs["weight"], inputs["bias"]) if t is not None]
    loss = loss_fn(inputs["hidden"], inputs["weight"], inputs["labels"], bias=inputs["bias"], **options)
    grads = torch.autograd.grad(
        loss * 0.37, leaves
    )  # a loss scale (the trainer's 1/tokens) reaches every gradient
    return float(loss.detach()), list(grads)


def _assert_close(got: tuple[float, list[torch.Tensor]], expected: tuple[float, list[torch.Tensor]]) -> None:
    assert abs(got[0] - expected[0]) <= REL * abs(expected[0]), (got[0], expected[0])
    for g, e in zip(got[1], expected[1], strict=True):
        assert float((g - e).abs().max()) <= REL * float(e.abs().max()), float((g - e).abs().max())


@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, None), (False, 5.0)])
def test_same_loss_and_gradients_as_the_full_logits_in_float32(bias, softcap):
    inputs = _inputs(bias)
    fused = _loss_and_grads(linear_cross_entropy, inputs, chunk_size=CHUNK, softcap=softcap)
    _assert_close(fused, _loss_and_grads(_unfused, inputs, softcap=softcap))


def test_the_chunk_size_does_not_change_the_numbers():
    inputs = _inputs()
    one_chunk = _loss_and_grads(linear_cross_entropy, inputs, chunk_size=10_000)
    for chunk in (1, 7, 86):
        _assert_close(_loss_and_grads(linear_cross_entropy, inputs, chunk_size=chunk), one_chunk)


class _WidestLogits(TorchDispatchMode):
    """The most rows of any new tensor (an op output that is not a view) as wide as the vocabulary
    (last dim), by dtype."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(a) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else (out,):
            if not isinstance(t, torch.Tensor) or _storage(t) in inputs:  # a view or in place: not new
                continue
            if t.dim() >= 2 and t.shape[-1] == self.vocab:
                rows = t.numel() // self.vocab
                self.rows[t.dtype] = max(self.rows.get(t.dtype, 0), rows)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("fused", [True, False])
def test_no_tokens_by_vocab_tensor_is_made_in_forward_or_backward(fused):
    inputs = _inputs()
    loss_fn = linear_cross_entropy if fused else _unfused
    options = {"chunk_size": CHUNK} if fused else {}
    with _WidestLogits(VOCAB) as watch:
        _loss_and_grads(loss_fn, inputs, **options)
    tokens = TOKENS[0] * TOKENS[1]
    if fused:  # at most one chunk of logits, in float32, whatever the token count
        assert watch.rows == {torch.float32: CHUNK}
    else:  # the full float32 logits (and their gradient)
        assert watch.rows[torch.float32] == tokens


def test_nothing_vocabulary_wide_is_saved_for_backward():
    inputs = _inputs()
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["labels"], chunk_size=CHUNK)
    tokens = TOKENS[0] * TOKENS[1]
    # the input, the weight (a parameter), the labels and one log-sum-exp per token
    assert sorted(saved) == sorted([(tokens, HIDDEN), (VOCAB, HIDDEN), (tokens,), (tokens,)])


def test_under_autocast_the_matmuls_run_in_bfloat16_and_the_weight_gradient_stays_float32():
    inputs = _inputs()
    seen: list[tuple[torch.dtype, ...]] = []

    class _MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    hidden = inputs["hidden"].detach().bfloat16().requires_grad_()  # the residual stream's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16), _MatmulDtypes():
        loss = linear_cross_entropy(hidden, inputs["weight"], inputs["labels"], chunk_size=CHUNK)
        expected = _unfused(hidden, inputs["weight"], inputs["labels"])
        # the weight gradient: 10-token chunks, in blocks of 33 of the 53 vocab rows
        loss.backward()
    assert seen and all(d == torch.bfloat16 for dtypes in seen for d in dtypes)
    assert loss.dtype == torch.float32 and inputs["weight"].grad.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16
    fused_grads = hidden.grad, inputs["weight"].grad
    hidden.grad = inputs["weight"].grad = None
    expected.backward()
    want = float(expected.detach())
    assert abs(float(loss.detach()) - want) <= 1e-2 * abs(want)  # bf16 logits either way
    for got, full in zip(fused_grads, (hidden.grad, inputs["weight"].grad), strict=True):
        assert float((got.float() - full.float()).abs().max()) <= 2e-2 * float(full.float().abs().max())


def _per_token_unfused(hidden, weight, labels, bias=None, softcap=None, temperature=1.0) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    losses = F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100, reduction="none"
    )
    return losses.view(labels.shape)


def _per_token_grads(
    loss_fn, inputs: dict[str, Any], **options: Any
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each token's loss, and the gradients of a weighted sum of them (a different weight per token, as a
    sequence-level loss gives)."""
    leaves = [t for t in (inputs["hidden"], inputs["weight"], inputs["bias"]) if t is not None]
    losses = loss_fn(inputs["hidden"], inputs["weight"], inputs["labels"], bias=inputs["bias"], **options)
    weights = torch.linspace(-1.0, 2.0, losses.numel()).view(losses.shape)
    return losses.detach(), list(torch.autograd.grad((losses * weights).sum(), leaves))


@pytest.mark.parametrize(("bias", "softcap", "temperature"), [(False, None, 1.0), (True, 5.0, 1.0), (False, None, 0.7),
                                                              (True, 5.0, 1.3)])  # fmt: skip
def test_per_token_losses_and_their_gradients_equal_the_full_logits(bias, softcap, temperature):
    inputs = _inputs(bias)
    got = _per_token_grads(linear_cross_entropy, inputs, chunk_size=CHUNK, softcap=softcap, reduction="none",
                           temperature=temperature)  # fmt: skip
    expected = _per_token_grads(_per_token_unfused, inputs, softcap=softcap, temperature=temperature)
    assert got[0].shape == inputs["labels"].shape
    assert bool((got[0][inputs["labels"] == -100] == 0).all())  # ignored tokens: 0
    torch.testing.assert_close(got[0], expected[0], rtol=REL, atol=1e-6)
    for g, e in zip(got[1], expected[1], strict=True):
        assert float((g - e).abs().max()) <= REL * float(e.abs().max()), float((g - e).abs().max())
    summed = linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["labels"], bias=inputs["bias"],
                                  chunk_size=CHUNK, softcap=softcap, temperature=temperature)  # fmt: skip
    assert float(summed) == pytest.approx(float(got[0].sum()), rel=1e-6)
    head = fuse_linear_cross_entropy(nn.Linear(HIDDEN, VOCAB, bias=False), chunk_size=CHUNK)
    assert set_head_reduction(nn.Sequential(head), "none") == 1
    assert head(inputs["hidden"], labels=inputs["labels"]).shape == inputs["labels"].shape


def _vocab_parallel(bias: bool, softcap: float | None) -> dict[str, Any] | None:
    """Each rank: the weight's vocab shard (53 rows: 27 and 26), the hidden state replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from d9d.mesh import DistributedContext

    inputs = _inputs(bias)
    expected = _loss_and_grads(_unfused, inputs, softcap=softcap)
    with DistributedContext.from_env(MeshConfig(tensor_parallel=2)) as ctx:
        mesh = ctx.mesh("dense")["tp"]
        hidden = inputs["hidden"].detach().requires_grad_()
        weight = distribute_tensor(inputs["weight"].detach(), mesh, [Shard(0)]).requires_grad_()
        bias_dt = (
            distribute_tensor(inputs["bias"].detach(), mesh, [Shard(0)]).requires_grad_() if bias else None
        )
        replicated = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        loss = linear_cross_entropy(
            replicated, weight, inputs["labels"], bias=bias_dt, chunk_size=CHUNK, softcap=softcap
        )
        (loss * 0.37).backward()
        grads = [hidden.grad, weight.grad.full_tensor()] + ([bias_dt.grad.full_tensor()] if bias else [])
        got = (float(loss.detach()), grads)
        _assert_close(got, expected)
        return {"local_rows": weight.to_local().shape[0], "loss": float(loss.detach())}


@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, 5.0)])
def test_vocab_parallel_over_two_tp_ranks_equals_one_process(bias, softcap):
    results = run_distributed(_vocab_parallel, 2, bias, softcap, timeout=120)
    assert [r["local_rows"] for r in results] == [27, 26]  # an uneven split of the vocabulary
    assert results[0]["loss"] == results[1]["loss"]  # every tp rank holds the whole loss


def test_a_head_computes_logits_without_labels_and_its_loss_with_them():
    inputs = _inputs()
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_(inputs["weight"])
    logits_before = head(inputs["hidden"])
    fuse_linear_cross_entropy(head, chunk_size=CHUNK)
    assert isinstance(head, LinearCrossEntropyHead) and list(dict(head.named_parameters())) == ["weight"]
    torch.testing.assert_close(head(inputs["hidden"]), logits_before, rtol=0, atol=0)
    expected = _unfused(inputs["hidden"], head.weight, inputs["labels"]).detach()
    loss = head(inputs["hidden"], labels=inputs["labels"]).detach()
    assert abs(float(loss) - float(expected)) <= REL * float(expected)


def test_heads_that_cannot_fuse_say_why():
    lora_model = nn.ModuleDict({"lm_head": nn.Linear(4, 8)})
    apply_lora(lora_model, LoraConfig(target_modules=["lm_head"]))
    assert "LoRA" in str(fused_head_problem(lora_model["lm_head"]))
    assert "not a plain nn.Linear" in str(fused_head_problem(nn.Conv1d(4, 8, 1)))
    with pytest.raises(ParallelizeError, match="LoRA"):
        fuse_linear_cross_entropy(lora_model["lm_head"])
    with pytest.raises(ParallelizeError, match="chunk_size must be >= 1"):
        fuse_linear_cross_entropy(nn.Linear(4, 8), chunk_size=0)


def test_bad_inputs_are_one_line_errors():
    inputs = _inputs()
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["labels"], chunk_size=0)
    with pytest.raises(ValueError, match="one label per token"):
        linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["labels"][:, :-1])
