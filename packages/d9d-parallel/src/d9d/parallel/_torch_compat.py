"""The torch calls of d9d.parallel that differ between the supported torch versions (2.11 to 2.15).

One function per difference; each docstring says which versions differ and how. Code elsewhere in
d9d.parallel calls these instead of checking versions itself.
"""

import contextlib
import functools
import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, checkpoint, create_selective_checkpoint_contexts

__all__ = [
    "all_gather_autograd",
    "around_stage_forward",
    "ignore_profiler_ranges_in_selective_checkpoints",
    "release_receive_buffers",
    "restore_receive_buffers",
    "schedule_step",
    "selective_checkpoint_options",
    "skip_warmup_to_own_rank",
    "traceable_grouped_mm_dtypes",
    "zero_bubble_custom_function_problem",
]

#: `context(stage_index, microbatch_index, probe)`: the context one stage forward runs in; `probe` is
#: torch's metadata-inference forward of the first step (not a microbatch of the step).
StageForwardContext = Callable[[int, int, bool], contextlib.AbstractContextManager[None]]


def all_gather_autograd(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` of every rank of `group` concatenated along dim 0, differentiable (the backward
    reduce-scatters the gradient back to its owners).

    torch 2.13 gave `funcol.all_gather_single` a backward (2.15 deprecates the `_autograd` variants).
    2.11 and 2.12 have only `funcol.all_gather_tensor_autograd`, whose backward refuses a
    non-contiguous gradient ("Expected input.is_contiguous()"), as a gradient coming back through
    views of the result (movedim, chunk) is: it gets the gradient made contiguous first.
    """
    gather = getattr(funcol, "all_gather_single", None)
    if gather is not None:
        return gather(x, 0, group)
    return _ContiguousGrad.apply(funcol.all_gather_tensor_autograd(x, 0, group))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def schedule_step(
    schedule: _PipelineSchedule,
    arg_mbs: list[tuple[Any, ...]] | None,
    kwarg_mbs: list[dict[str, Any]] | None,
    target_mbs: list[Any] | None,
    losses: list[torch.Tensor],
) -> None:
    """Run one step of a torch pipeline schedule over microbatches that the caller already split.

    torch 2.14 added the `arg_mbs=`, `kwarg_mbs=`, `target_mbs=` keywords to `step()`. Before (2.11
    to 2.13), `step()` splits a whole batch itself and passes unknown keywords on to the model; the
    pre-split path there is the schedule's `_step_microbatches`, preceded by what `step()` does
    first on every stage (set its backward flag, clear its per-step state). The caller checks that
    gradients are enabled (`step()` refuses to train under `torch.no_grad()`).
    """
    if _takes_pre_split(type(schedule)):
        schedule.step(
            arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses, return_outputs=False
        )
        return
    has_backward = schedule._has_backward
    stages = schedule._stages if isinstance(schedule, PipelineScheduleMulti) else [schedule._stage]
    for stage in stages:
        stage.has_backward = has_backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, False)


def _takes_pre_split(schedule_class: type) -> bool:
    return "arg_mbs" in inspect.signature(schedule_class.step).parameters


def skip_warmup_to_own_rank(stage: PipelineStage) -> None:
    """Keep `stage`'s communicator warm-up from sending to its own rank.

    torch 2.11 warms up a multi-stage schedule by sending a dummy tensor to every neighbour stage,
    even one on the same rank (the V schedules, ZBV and DualPipeV, place stages 1 and 2 of a pp 2
    pipeline together), which gloo refuses ("Pair is not connected"). 2.12 and 2.13 warm a
    `PipelineStage` up by a vote between ranks and never call the method patched here; 2.15 has
    no such method.
    """
    legacy = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if legacy is None:
        return
    own = stage.group_rank

    def to_other_ranks() -> list[dist.P2POp]:
        return [op for op in legacy() if op.group_peer != own]

    stage._get_init_p2p_neighbors_ops = to_other_ranks  # type: ignore[method-assign]


def around_stage_forward(stage: PipelineStage, context: StageForwardContext) -> bool:
    """Run every forward of `stage` inside `context(stage_index, microbatch_index, probe)`; False where
    this torch cannot.

    torch 2.15's `PipelineStage.register_forward_context` calls its factory with each forward's stage,
    microbatch index and whether it is the metadata-inference probe; versions without that method
    give no such place, and the caller falls back to one context around the whole step.
    """
    register = getattr(stage, "register_forward_context", None)
    if register is None:
        return False

    def factory(info: Any) -> contextlib.AbstractContextManager[None]:
        return context(info.stage_index, info.microbatch_index, info.is_metadata_inference)

    register(factory)
    return True


def traceable_grouped_mm_dtypes(grouped_mm: Callable[..., torch.Tensor] | None) -> frozenset[torch.dtype]:
    """The floating dtypes `torch.compile` can trace `grouped_mm` in (run on meta tensors, as tracing does).

    torch 2.11's meta kernel of the grouped GEMM takes bfloat16 only ("Expected inputs of BF16 type"),
    though its CPU kernel runs float32 too, so a compiled float32 bank fails there; 2.15's takes float32,
    bfloat16 and float16.
    """
    if grouped_mm is None:
        return frozenset()
    traceable = set()
    offs = torch.tensor([16], dtype=torch.int32, device="meta")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = (torch.empty(shape, dtype=dtype, device="meta") for shape in ((16, 16), (1, 16, 16)))
        try:
            grouped_mm(x, w, offs=offs)
        except RuntimeError:
            continue
        traceable.add(dtype)
    return frozenset(traceable)


def selective_checkpoint_options(policy: Callable[..., Any]) -> dict[str, Any]:
    """The `torch.utils.checkpoint.checkpoint` keywords of a per-op `policy` whose saved outputs pass
    through the saved-tensor hooks around the call, as autograd's own saved tensors do (so
    `saved_activation_bytes` and any hook counting what backward keeps see them).

    torch 2.14 added `respect_saved_tensors_hooks` for that (without it the policy's cache bypasses
    the hooks). Before (2.11 to 2.13), the cache the two contexts share (a dict of lists, one list per
    op) is replaced here by one that packs each cached tensor with the hooks in force when the region
    starts and unpacks it when the recompute takes it (without the mutation check torch makes).
    """
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        return {"context_fn": context_fn, "respect_saved_tensors_hooks": True}
    return {"context_fn": functools.partial(_contexts_through_hooks, policy)}


def _contexts_through_hooks(policy: Callable[..., Any]) -> tuple[Any, Any]:
    caching, cached = create_selective_checkpoint_contexts(policy)
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    storage = getattr(caching, "storage", None)
    if hooks is None or storage is not getattr(cached, "storage", None) or not _is_list_cache(storage):
        return caching, cached
    caching.storage = cached.storage = defaultdict(functools.partial(_HookedOutputs, *hooks))
    return caching, cached


def _is_list_cache(storage: Any) -> bool:
    return isinstance(storage, defaultdict) and storage.default_factory is list


class _HookedOutputs(list):
    """One op's cached outputs (torch < 2.14): each tensor packed on `append`, unpacked when taken."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
        super().__init__()
        self._pack, self._unpack = pack, unpack

    def append(self, entry: Any) -> None:
        super().append(tree_map(self._packed, entry))

    def _packed(self, leaf: Any) -> Any:
        value = getattr(leaf, "val", None)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
            return leaf
        return _Packed(self._pack(value), self._unpack)


class _Packed:
    """A cached tensor as the hooks packed it; `get_val` is what the recompute calls."""

    def __init__(self, packed: Any, unpack: Callable[[Any], torch.Tensor]) -> None:
        self._packed, self._unpack = packed, unpack

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        del allow_cache_entry_mutation
        return self._unpack(self._packed)


def ignore_profiler_ranges_in_selective_checkpoints() -> None:
    """Leave the profiler's range ops out of every selective checkpoint's replay (torch's own
    `SAC_IGNORED_OPS`); idempotent.

    torch 2.15 replays a selective region by counting each op's calls, and refuses a recompute that
    calls one more often than the forward did. FSDP2 opens a profiler range (`record_function`)
    around its hooks, and a unit inside a block (an expert bank under expert parallelism) opens more
    of them in the recompute than in the forward ("invocation index 2 encountered during backward
    but not found in storage"). The ranges are annotations: run each time, never cached. (torch 2.11
    looks up only the ops its policy saves; 2.12 to 2.14 were not checked.)
    """
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            SAC_IGNORED_OPS.update(getattr(packet, overload) for overload in packet.overloads())


def release_receive_buffers(stage: PipelineStage) -> int:
    """Free the receive buffers `stage` keeps between steps; returns how many bytes that frees.

    torch 2.11 gives every non-first stage one activation receive buffer per microbatch, and every
    non-last stage one gradient receive buffer per microbatch, at the first step, and keeps them
    (or the tensors a stage on the same rank handed over instead) for the stage's life: 2 ×
    microbatches × one activation per middle stage, held between steps. torch 2.15 allocates each
    buffer right before its receive and drops it once consumed (its `_RecvInfo.take_buffer`):
    nothing is left to free there. Each kept buffer becomes a meta tensor of its shape, dtype and
    `requires_grad`; `restore_receive_buffers` allocates it again before the next step.
    """
    freed: dict[int, int] = {}
    for info in _kept_receives(stage):
        buffer = info.buffer
        storage = buffer.untyped_storage()
        freed[storage._cdata] = storage.nbytes()
        info.buffer = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta").requires_grad_(
            buffer.requires_grad
        )
    return sum(freed.values())


def restore_receive_buffers(stage: PipelineStage) -> None:
    """Allocate again, on the stage's device, the buffers `release_receive_buffers` freed."""
    for info in _kept_receives(stage):
        kept = info.buffer
        if kept.device.type == "meta":
            info.buffer = torch.empty(kept.shape, dtype=kept.dtype, device=stage.device).requires_grad_(
                kept.requires_grad
            )


def _kept_receives(stage: PipelineStage) -> Iterator[Any]:
    """The receive descriptors of `stage` that keep a buffer across steps (torch before per-receive buffers)."""
    for table in (stage.args_recv_info, getattr(stage, "grad_recv_info", {})):
        for infos in table.values():
            for info in infos:
                if hasattr(type(info), "take_buffer"):  # buffers allocated per receive: none kept
                    return
                if isinstance(getattr(info, "buffer", None), torch.Tensor):
                    yield info


@functools.cache
def zero_bubble_custom_function_problem() -> str | None:
    """Why this torch's zero-bubble schedules cannot split a backward that runs through a custom
    autograd Function (e.g. the fused head loss), or None when they can.

    torch 2.11's weight-gradient pass (`stage_backward_weight`) hands `autograd.grad` gradient edges
    of the graph's nodes, and reading a Python Function node's metadata there raises ("Attribute
    '_input_metadata' is invalid"); 2.15 runs it. Probed once on three tiny CPU tensors.
    """
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    weight = nn.Parameter(torch.ones(3, 2))
    x = torch.ones(4, 2, requires_grad=True)
    try:
        loss = _ProbeProduct.apply(x * 2, weight)
        _, groups = stage_backward_input([loss], None, [x], iter([weight]))
        stage_backward_weight(iter([weight]), groups)
    except RuntimeError as exc:
        del exc  # e.g. "Attribute '_input_metadata' is invalid for this instance of _C._FunctionBase"
        return f"torch {torch.__version__.split('+')[0]} cannot split its backward in a zero-bubble schedule"
    return None


class _ProbeProduct(torch.autograd.Function):
    """sum(h @ w.T), with a backward of its own: the smallest custom Function for the probe."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, w)
        return (h @ w.t()).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = ctx.saved_tensors
        ones = grad * torch.ones(h.shape[0], w.shape[0], dtype=h.dtype)
        return ones @ w, ones.t() @ h
