"""Tensor parallelism: plans for the standard transformer pieces and a loss without a vocab gather.

A plan maps module names (relative to the module being parallelized; `*` matches one name level,
e.g. "blocks.*.attn") to DTensor `ParallelStyle`s. Compose the pieces of a model's plan with `|`:

    plan = (
        embedding_plan("embed")
        | attention_plan("blocks.*.attn", qkv=("q", "k", "v"), out="o")
        | mlp_plan("blocks.*.mlp", up=("gate", "up"), down="down")
        | norm_plan("blocks.*.attn_norm", "blocks.*.mlp_norm", "norm")
        | lm_head_plan("lm_head")
    )
    parallelize_tensor_parallel(model, ctx.mesh("dense"), plan)

With `sequence_parallel=True` (the default everywhere) the residual stream between blocks is sharded
on the sequence dim (dim 1) and norms run on their own sequence shard; attention and MLP inputs are
all-gathered on entry and reduce-scattered on exit. The sequence length must divide by tp then.
The embedding is vocab-parallel (rows of the table split over tp); the LM head is column-parallel and
returns logits sharded on the vocab dim, which `cross_entropy` consumes without gathering them
(forward and backward must run inside `loss_parallel()`).
Attention code must read the local head count from its tensors (`view(b, t, -1, head_dim)`).
"""

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from d9d.parallel._mesh_axes import axis_names, axis_size
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "ReplicateParallel",
    "TensorParallelPlan",
    "attention_plan",
    "cross_entropy",
    "embedding_plan",
    "lm_head_plan",
    "loss_parallel",
    "mlp_plan",
    "norm_plan",
    "parallelize_tensor_parallel",
]

TensorParallelPlan = dict[str, ParallelStyle]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _sharded_or_replicated(sequence_parallel: bool) -> Shard | Replicate:
    return Shard(1) if sequence_parallel else Replicate()


def _gather_input(sequence_parallel: bool, extra_inputs: int) -> PrepareModuleInput:
    """The hidden state (first input) as a full, replicated tensor; other inputs untouched."""
    return PrepareModuleInput(
        input_layouts=(_sharded_or_replicated(sequence_parallel), *[None] * extra_inputs),
        desired_input_layouts=(Replicate(), *[None] * extra_inputs),
        use_local_output=True,
    )


def attention_plan(
    attention: str,
    *,
    qkv: Sequence[str] = ("q", "k", "v"),
    out: str = "o",
    sequence_parallel: bool = True,
    extra_inputs: int = 0,
) -> TensorParallelPlan:
    """Split attention heads over tp: q/k/v projections column-wise, the output projection row-wise.

    Args:
        attention: name of the attention module (its first forward argument is the hidden state).
        qkv: names of the input projections inside it (one fused name works too).
        out: name of the output projection inside it.
        extra_inputs: positional arguments after the hidden state (rotary tables, masks), passed on
            unchanged.
    """
    plan: TensorParallelPlan = {attention: _gather_input(sequence_parallel, extra_inputs)}
    for name in qkv:
        plan[_join(attention, name)] = ColwiseParallel()
    plan[_join(attention, out)] = RowwiseParallel(output_layouts=_sharded_or_replicated(sequence_parallel))
    return plan


def mlp_plan(
    mlp: str,
    *,
    up: Sequence[str] = ("gate", "up"),
    down: str = "down",
    sequence_parallel: bool = True,
) -> TensorParallelPlan:
    """Split the MLP hidden dim over tp: `up` projections column-wise, `down` row-wise."""
    plan: TensorParallelPlan = {mlp: _gather_input(sequence_parallel, 0)}
    for name in up:
        plan[_join(mlp, name)] = ColwiseParallel()
    plan[_join(mlp, down)] = RowwiseParallel(output_layouts=_sharded_or_replicated(sequence_parallel))
    return plan


def norm_plan(*names: str, sequence_parallel: bool = True) -> TensorParallelPlan:
    """Norms with weights replicated over tp: on their sequence shard, or on the full replicated input.

    Either way the weights become DTensors, so every parameter of the model is one (foreach
    optimizers refuse a mix of DTensors and plain tensors).
    """
    style: ParallelStyle = SequenceParallel() if sequence_parallel else ReplicateParallel()
    return dict.fromkeys(names, style)


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters over tp; it computes on its plain inputs as before.

    `input_layouts` says what each rank's input is: `Replicate()` (the same on every tp rank, the
    default) or e.g. `Shard(2)` when every rank holds a different slice of it, such as the attention
    heads a per-head norm (q_norm / k_norm) sees. With a sharded input the weight's gradient is the
    sum of the ranks' parts (DTensor all-reduces it in backward), so the replicas stay equal.
    """

    def __init__(self, *, input_layouts: Placement | None = None) -> None:
        super().__init__()
        self.input_layouts = input_layouts if input_layouts is not None else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layouts

        def to_dtensor(
            _module: nn.Module, inputs: tuple[object, ...], mesh: DeviceMesh
        ) -> tuple[object, ...]:
            return tuple(
                DTensor.from_local(x, mesh, [layout], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(_module: nn.Module, outputs: object, _mesh: DeviceMesh) -> object:
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


class _VocabParallelEmbedding(RowwiseParallel):
    """RowwiseParallel on an embedding whose weight gradient keeps the weight's `Shard(0)`.

    DTensor's embedding backward returns the table's gradient replicated, at full size on every tp
    rank (a 128k x 4096 vocabulary: 2 GB of fp32 per rank, held from the backward to the optimizer
    step). A hook on the weight takes each rank's rows of it before it is accumulated (a local
    slice, no communication). It is put on the weight at forward, once per parameter object, because
    materializing a meta model (`to_empty`) replaces a DTensor parameter and its hooks. Under FSDP
    the unsharded weight gets it too, harmlessly (FSDP2 itself reduces a gradient in its parameter's
    tp placement).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_pre_hook(_keep_gradient_placement)
        return module


def _keep_gradient_placement(module: nn.Module, args: object) -> None:
    weight = module.weight
    if not isinstance(weight, DTensor) or not weight.requires_grad:
        return
    hooks = weight._backward_hooks or {}  # a copy of the parameter (deepcopy, pickling) has none
    if not any(isinstance(hook, _ToPlacements) for hook in hooks.values()):
        weight.register_hook(_ToPlacements(tuple(weight.placements)))


class _ToPlacements:
    """The gradient hook: the gradient redistributed to the weight's placements (a local slice)."""

    def __init__(self, placements: tuple[Placement, ...]) -> None:
        self.placements = placements

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return _to_placements(grad, self.placements)


def _to_placements(grad: torch.Tensor, placements: Sequence[Placement]) -> torch.Tensor:
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def embedding_plan(name: str, *, sequence_parallel: bool = True) -> TensorParallelPlan:
    """Vocab-parallel embedding: the table's rows are split over tp, outputs summed (or reduce-scattered);
    its gradient stays split like the table."""
    return {
        name: _VocabParallelEmbedding(
            input_layouts=Replicate(),
            output_layouts=_sharded_or_replicated(sequence_parallel),
        )
    }


def lm_head_plan(
    name: str, *, sequence_parallel: bool = True, loss_parallel: bool = True
) -> TensorParallelPlan:
    """Column-parallel LM head: each tp rank computes the logits of its slice of the vocabulary.

    With `loss_parallel=True` the logits stay a DTensor sharded on the vocab dim for `cross_entropy`;
    with False they are all-gathered into a plain tensor (simple, but a full-vocab gather). A
    `LinearCrossEntropyHead` given `labels=` returns its vocab-parallel loss instead, gathering nothing
    but the hidden states' sequence.
    """
    return {
        name: _ColumnParallelHead(
            input_layouts=_sharded_or_replicated(sequence_parallel),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    }


class _ColumnParallelHead(ColwiseParallel):
    """ColwiseParallel whose module may also return a plain tensor (a fused head's loss), passed on as is."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Placement,
        use_local_output: bool,
        mod: nn.Module,
        outputs: object,
        device_mesh: DeviceMesh,
    ) -> object:
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def parallelize_tensor_parallel(
    module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], *, axis: str = "tp"
) -> nn.Module:
    """Apply `plan` over the `axis` of `mesh` (the whole `dense` mesh is fine); a no-op when tp is 1.

    Call it before `parallelize_fsdp`/`parallelize_hsdp` on the same mesh: FSDP then shards the
    tensor-parallel DTensors further over the data axes (2-D parallelism).
    """
    names = axis_names(mesh)
    if axis not in names:
        raise ParallelizeError(f"parallelize_tensor_parallel: the mesh {names} has no axis {axis!r}")
    if axis_size(mesh, axis) == 1:
        return module
    tp_mesh = mesh if names == (axis,) else mesh[axis]
    return parallelize_module(module, tp_mesh, dict(plan))


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    reduction: str = "sum",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Token cross-entropy of (..., vocab) logits against (...) targets, plain or vocab-sharded.

    For logits that are a DTensor sharded on the vocab dim (`lm_head_plan(loss_parallel=True)`) the
    loss is computed without gathering the vocabulary; call this and `backward()` inside
    `with loss_parallel():`. The result is always a plain tensor, equal on every tp rank.
    """
    flat_logits = logits.flatten(0, -2)
    flat_targets = targets.flatten()
    loss = F.cross_entropy(flat_logits, flat_targets, reduction=reduction, ignore_index=ignore_index)
    if isinstance(loss, DTensor):
        loss = loss.redistribute(placements=[Replicate()] * loss.device_mesh.ndim).to_local()
    return loss
