"""The LM head and its cross-entropy fused over chunks of tokens: no [tokens, vocab] logits tensor exists.

    loss = linear_cross_entropy(hidden, head.weight, labels, chunk_size=1024)   # summed, float32

At 8,192 tokens × 128,256 vocabulary the unfused loss holds the logits in float32 (4.2 GB), the
log-softmax it saves for backward (4.2 GB) and their gradient. Here the forward computes each chunk's
logits (`chunk_size` tokens) in the compute dtype, upcasts them to float32 for a stable log-sum-exp
and keeps only that log-sum-exp per token; the backward recomputes each chunk's logits and
accumulates the input's and the weight's gradients (the weight's in float32), so at most one chunk's
logits and their gradient are alive. The price is one more head matmul (the recompute), about a third
more head FLOPs; the numbers are those of `F.cross_entropy(logits.float(), labels, reduction="sum")`
within float rounding (`benchmarks/fused_loss.py` measures both).

Tensor parallelism: a weight that is a DTensor sharded on the vocab dim (`Shard(0)` on a 1-D tp mesh,
`lm_head_plan`) with a replicated hidden state is the vocab-parallel loss: each tp rank computes its
shard's chunk logits, the log-sum-exp is combined over tp (one all-reduce of the max, one of the
sum of exponentials and the target logit, which only the rank owning the target contributes), and the
hidden state's gradient is each rank's partial sum (DTensor reduces it). A replicated weight
computes whole on every rank.

FSDP2 gathers a weight in its module's forward pre-hook, so call this inside the head's forward:
`LinearCrossEntropyHead` is an `nn.Linear` whose `forward(hidden, labels=labels)` does,
and `fuse_linear_cross_entropy` turns a model's plain `nn.Linear` head into one in place.
"""

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from d9d.parallel.errors import ParallelizeError
from d9d.parallel.weight_casts import step_copy

__all__ = [
    "LinearCrossEntropyHead",
    "describe_fused_loss",
    "fuse_linear_cross_entropy",
    "fused_head_problem",
    "linear_cross_entropy",
    "set_head_reduction",
]

_FP32 = torch.float32


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: Literal["sum", "none"] = "sum",
    temperature: float = 1.0,
) -> torch.Tensor:
    """The summed token cross-entropy (float32, 0-dim) of `hidden @ weight.T + bias` against `labels`;
    with `reduction="none"`, each token's (float32, `labels`' shape; 0 where ignored), e.g. the negated
    log-probabilities of completions that a preference loss sums per sequence.

    Args:
        hidden: [..., hidden] input of the head; computed in autocast's dtype when autocast is on for
            its device, else in its own dtype (the weight is cast to it, once).
        weight: [vocab, hidden]; or its vocab shard as a DTensor (`Shard(0)` on a 1-D tp mesh, with
            `hidden` a replicated DTensor on it), or a replicated DTensor.
        labels: [...] target ids (the leading dims of `hidden`); `ignore_index` ones add nothing.
        chunk_size: tokens per chunk: the most logits alive at once are chunk_size × vocab (÷ tp).
        softcap: Gemma's final-logit soft-capping, `softcap * tanh(logits / softcap)`, or None.
        temperature: the (capped) logits are divided by it before the softmax: the loss is that of the
            distribution sampled at this temperature (e.g. the policy's log-probabilities in RL).

    Raises:
        ValueError: `chunk_size` below 1, `labels` not matching `hidden`'s leading dims, or a DTensor
            layout other than those above.
    """
    if not temperature > 0:
        raise ValueError(f"linear_cross_entropy: temperature must be > 0, got {temperature}")
    if reduction not in ("sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'sum' or 'none', got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(
            f"linear_cross_entropy: chunk_size must be >= 1 (tokens per chunk), got {chunk_size}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: labels {tuple(labels.shape)} must have hidden's leading shape "
            f"{tuple(hidden.shape[:-1])} (one label per token)"
        )
    device_type = hidden.device.type
    dtype = hidden.dtype
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    copy = step_copy(weight, dtype)  # inside the trainer's step: one cast of the head for all microbatches
    if isinstance(copy, DTensor):
        copy = copy.to_local()
    hidden, weight, bias, shard = _local_operands(hidden, weight, bias)
    loss = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        labels.reshape(-1),
        _Options(
            chunk_size,
            ignore_index,
            softcap,
            dtype,
            *shard,
            per_token=reduction == "none",
            temperature=temperature,
        ),
        copy,
    )
    return loss if reduction == "sum" else loss.view(labels.shape)


@dataclass(frozen=True)
class _Options:
    """The op's non-tensor inputs: chunking, dtype and (vocab-parallel) this rank's shard of the vocab."""

    chunk_size: int
    ignore_index: int
    softcap: float | None
    dtype: torch.dtype
    group: dist.ProcessGroup | None
    vocab_start: int
    per_token: bool = False  # each token's loss, not their sum
    temperature: float = 1.0  # the logits (after any cap) are divided by it


def _local_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[dist.ProcessGroup | None, int]]:
    """Plain tensors to compute on, and (the tp group, the first vocab id this rank holds) when the
    weight is vocab-sharded; each local tensor's gradient goes back in its DTensor's placement."""
    if not isinstance(weight, DTensor):
        if isinstance(hidden, DTensor):
            raise ValueError(
                "linear_cross_entropy: hidden is a DTensor but the weight is not; pass both or neither"
            )
        return hidden, weight, bias, (None, 0)
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements not in ((Shard(0),), (Replicate(),)):
        raise ValueError(
            f"linear_cross_entropy: the weight's layout {placements} on a {mesh.ndim}-D mesh is not supported; "
            "shard it on the vocab dim (Shard(0)) over the tp mesh alone, or replicate it"
        )
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    hidden = hidden.redistribute(mesh, [Replicate()])
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    if placements == (Replicate(),):
        return hidden.to_local(), weight.to_local(), local_bias, (None, 0)
    # Each rank's hidden-state gradient is its vocab shard's part of the sum: Partial, reduced by DTensor.
    local_weight = weight.to_local()
    vocab, rank, size = weight.shape[0], mesh.get_local_rank(), mesh.size()
    rows = -(-vocab // size)  # torch's Shard(0): chunks of ceil(vocab / tp) rows, the last ones shorter
    start = min(rank * rows, vocab)
    if local_weight.shape[0] != min(rows, vocab - start):
        raise ValueError(
            f"linear_cross_entropy: tp rank {rank} holds {local_weight.shape[0]} vocab rows, not the "
            f"{min(rows, vocab - start)} of an even Shard(0) split of {vocab}; shard the weight with distribute_tensor"
        )
    return hidden.to_local(grad_placements=[Partial()]), local_weight, local_bias, (mesh.get_group(), start)


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast off on `device` (the op casts itself, once); nothing to turn off on meta (planning)."""
    return contextlib.nullcontext() if device.type == "meta" else torch.autocast(device.type, enabled=False)


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's float32 logits [chunk, vocab (local)] (capped, then divided by the temperature), and
    tanh(raw / softcap) when capped (for backward)."""
    raw = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())
    logits = raw.to(_FP32)  # a new tensor only when the compute dtype is not float32
    if softcap is None:
        return (logits if temperature == 1.0 else logits.div_(temperature)), None
    capped = torch.tanh(logits / softcap)
    return capped * (softcap / temperature), capped


def _target_logits(
    logits: torch.Tensor, labels: torch.Tensor, options: _Options
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each token's logit of its label where this rank holds it, else 0; the label's local column;
    whether this rank holds it and it is not ignored)."""
    local = labels - options.vocab_start
    owned = (labels != options.ignore_index) & (local >= 0) & (local < logits.shape[1])
    column = torch.where(owned, local, torch.zeros_like(local))
    picked = logits.gather(1, column.unsqueeze(1)).squeeze(1)
    return torch.where(owned, picked, torch.zeros_like(picked)), column, owned


def _log_sum_exp(logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[
    torch.Tensor, torch.Tensor
]:  # fmt: skip
    """(log-sum-exp over the whole vocabulary, the target logit summed over tp); overwrites `logits`."""
    peak = logits.amax(dim=1)
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sums = logits.sub_(peak.unsqueeze(1)).exp_().sum(dim=1)
    if group is not None:
        both = torch.stack([sums, target])
        dist.all_reduce(both, group=group)
        sums, target = both[0], both[1]
    return peak + sums.log(), target


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed loss and each token's log-sum-exp; backward: the chunks' logits again."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        options: _Options,
        weight_copy: torch.Tensor | None,
    ) -> torch.Tensor:
        with _no_autocast(hidden.device):
            h = hidden.to(options.dtype)
            # the step's copy (`weights_cast_once`), else one cast per forward; none when in dtype
            w = weight_copy if weight_copy is not None else weight.to(options.dtype)
            b = bias.to(options.dtype) if bias is not None else None
            log_sum_exp = torch.empty(h.shape[0], dtype=_FP32, device=h.device)
            total = torch.zeros((), dtype=_FP32, device=h.device)
            per_token = torch.zeros(h.shape[0], dtype=_FP32, device=h.device) if options.per_token else None
            for start in range(0, h.shape[0], options.chunk_size):
                end = start + options.chunk_size
                logits, _ = _chunk_logits(h[start:end], w, b, options.softcap, options.temperature)
                target, _, _ = _target_logits(logits, labels[start:end], options)
                lse, target = _log_sum_exp(logits, target, options.group)
                del logits
                log_sum_exp[start:end] = lse
                counted = labels[start:end] != options.ignore_index
                losses = torch.where(counted, lse - target, torch.zeros_like(lse))
                if per_token is not None:
                    per_token[start:end] = losses
                else:
                    total += losses.sum()
        ctx.save_for_backward(h, w, b, labels, log_sum_exp)
        ctx.options = options  # type: ignore[attr-defined]
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)  # type: ignore[attr-defined]
        return per_token if per_token is not None else total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor) -> tuple[
        torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None
    ]:  # fmt: skip
        h, w, b, labels, log_sum_exp = ctx.saved_tensors  # type: ignore[attr-defined]
        options: _Options = ctx.options  # type: ignore[attr-defined]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=_FP32, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=_FP32, device=w.device) if need_b else None
        scale = grad_loss.to(_FP32)
        with _no_autocast(h.device):
            for start in range(0, h.shape[0], options.chunk_size):
                end = start + options.chunk_size
                chunk_scale = scale[start:end] if options.per_token else scale  # each token's gradient
                grad = _chunk_grad(
                    h[start:end], w, b, labels[start:end], log_sum_exp[start:end], chunk_scale, options
                )
                if grad_h is not None:
                    torch.mm(grad, w, out=grad_h[start:end])
                if grad_w is not None:
                    _accumulate(grad_w, grad.t(), h[start:end])
                if grad_b is not None:
                    grad_b += grad.sum(dim=0, dtype=_FP32)
        hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes  # type: ignore[attr-defined]
        return (
            grad_h.to(hidden_dtype) if grad_h is not None else None,
            grad_w.to(weight_dtype) if grad_w is not None else None,
            grad_b.to(bias_dtype) if grad_b is not None and bias_dtype is not None else None,
            None,
            None,
            None,
        )


def _chunk_grad(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    labels: torch.Tensor,
    log_sum_exp: torch.Tensor,
    scale: torch.Tensor,
    options: _Options,
) -> torch.Tensor:
    """d loss / d raw logits of one chunk, in the compute dtype: (softmax − one-hot) × the loss's gradient
    (0-dim, or one per token of the chunk), zero for ignored tokens, through the soft-cap when there is one."""
    logits, capped = _chunk_logits(h, w, b, options.softcap, options.temperature)
    _, column, owned = _target_logits(logits, labels, options)
    probs = logits.sub_(log_sum_exp.unsqueeze(1)).exp_()
    probs.scatter_add_(1, column.unsqueeze(1), -owned.to(_FP32).unsqueeze(1))
    counted = (labels != options.ignore_index).to(_FP32) * (scale / options.temperature)
    probs.mul_(counted.unsqueeze(1))
    if capped is not None:  # d(s·tanh(x/s))/dx = 1 − tanh²
        probs.mul_(capped.square_().neg_().add_(1.0))
    return probs.to(options.dtype)


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """`total += left @ right` in float32 ([vocab, chunk] @ [chunk, hidden]): in place when the operands
    are float32, else through products in their dtype (the float32 sum keeps the chunks' rounding from
    adding up), a block of vocab rows at a time so that no product outgrows the chunk's logits."""
    if left.dtype == _FP32:
        total.addmm_(left, right)
        return
    rows = max(1, left.numel() // right.shape[1])  # [rows, hidden] holds as many numbers as [vocab, chunk]
    for start in range(0, left.shape[0], rows):
        total[start : start + rows] += left[start : start + rows] @ right


class LinearCrossEntropyHead(nn.Linear):
    """An LM head that can compute its own loss: `head(hidden)` is the logits, as `nn.Linear`'s;
    `head(hidden, labels=labels)` is the summed token cross-entropy (`linear_cross_entropy`), so it
    runs inside the module's forward, where FSDP2 has gathered the weight and tensor parallelism
    has prepared the input. Make one from a model's head with `fuse_linear_cross_entropy`.

    Attributes:
        chunk_size: tokens per chunk of the fused loss.
        softcap: the logits' soft cap (Gemma's `final_logit_softcapping`), or None.
        ignore_index: the label that adds nothing (d9d.data's IGNORE_INDEX, -100).
        reduction: "sum" (the summed loss), or "none": each token's loss, labels' shape (a task that
            scores whole sequences, e.g. preference optimization, sets it on the model's heads:
            `set_head_reduction`).
        temperature: the logits are divided by it before the loss (RL's sampling temperature;
            `set_head_reduction(..., temperature=)`).
    """

    chunk_size: int = 1024
    reduction: Literal["sum", "none"] = "sum"
    temperature: float = 1.0
    softcap: float | None = None
    ignore_index: int = -100
    casts_weight_once: bool = True  # inside `weights_cast_once` the loss computes from the step's copy

    def forward(self, input: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The logits of `input`, or with `labels` (pass it by keyword) the summed loss against them."""
        if labels is None:
            return super().forward(input)
        return linear_cross_entropy(
            input,
            self.weight,
            labels.to(input.device),
            bias=self.bias,
            chunk_size=self.chunk_size,
            ignore_index=self.ignore_index,
            softcap=self.softcap,
            reduction=self.reduction,
            temperature=self.temperature,
        )


def set_head_reduction(
    model: nn.Module, reduction: Literal["sum", "none"], *, temperature: float = 1.0
) -> int:
    """Make every fused head of `model` (`LinearCrossEntropyHead`) return its loss summed or per token
    when given labels, of its logits divided by `temperature`; how many heads it set."""
    heads = [m for m in model.modules() if isinstance(m, LinearCrossEntropyHead)]
    for head in heads:
        head.reduction, head.temperature = reduction, temperature
    return len(heads)


def fused_head_problem(head: nn.Module | None) -> str | None:
    """Why `head` cannot compute its loss fused (None when it can): it must be a plain `nn.Linear`
    whose forward nothing replaced (no LoRA adapter, no float8 conversion)."""
    if head is None:
        return "the model has no head"
    if isinstance(head, LinearCrossEntropyHead):
        return None
    if type(head) is not nn.Linear:
        return f"the head is a {type(head).__name__}, not a plain nn.Linear (e.g. float8-converted)"
    if "forward" in vars(head):
        return "the head's forward is wrapped (e.g. a LoRA adapter on it)"
    return None


def fuse_linear_cross_entropy(
    head: nn.Module, *, chunk_size: int = 1024, softcap: float | None = None, ignore_index: int = -100
) -> LinearCrossEntropyHead:
    """Make `head` (a plain `nn.Linear`) a `LinearCrossEntropyHead` in place, keeping its parameters,
    hooks and name; returns it. Call it before FSDP (`parallelize_hsdp` subclasses the module's class),
    after tensor parallelism and LoRA.

    Raises:
        ParallelizeError: `fused_head_problem(head)` names a reason, or `chunk_size` is below 1.
    """
    problem = fused_head_problem(head)
    if problem is not None:
        raise ParallelizeError(f"fuse_linear_cross_entropy: {problem}; keep the unfused loss for this model")
    if chunk_size < 1:
        raise ParallelizeError(
            f"fuse_linear_cross_entropy: chunk_size must be >= 1 (tokens), got {chunk_size}"
        )
    head.__class__ = LinearCrossEntropyHead
    assert isinstance(head, LinearCrossEntropyHead)
    head.chunk_size, head.softcap, head.ignore_index = chunk_size, softcap, ignore_index
    return head


def describe_fused_loss(*models: nn.Module) -> str | None:
    """ "fused head + cross-entropy, N tokens per chunk" when `models` hold a `LinearCrossEntropyHead`
    (for a job's log line and plan), else None."""
    heads = [m for model in models for m in model.modules() if isinstance(m, LinearCrossEntropyHead)]
    return f"fused head + cross-entropy, {heads[0].chunk_size} tokens per chunk" if heads else None
