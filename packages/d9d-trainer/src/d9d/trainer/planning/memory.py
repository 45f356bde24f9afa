"""The per-rank memory estimate of a plan: persistent training state, and one microbatch's activations.

The state figure is a deliberately simple estimate (no temporary buffers, no allocator slack), see
`estimate_memory`. The activations are counted from a forward on the meta device in the plan's
compute dtype, with and without activation checkpointing (`estimate_activations`). Under context
parallelism that forward runs one rank's share of the sequence with the planned cp group, as the
trainer will. Building the model for it runs the model provider and the trainer's checks of what it
built (`d9d.trainer.build.shape_model`), so a job the trainer would refuse is refused here too.
"""

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from d9d.mesh import DistributedContext
from d9d.parallel import (
    ActivationCheckpointingConfig,
    MixedPrecision,
    apply_activation_checkpointing,
    parallelize_context_parallel,
    saved_activation_bytes,
)
from d9d.trainer.build import shape_model
from d9d.trainer.job import ResolvedJob
from d9d.trainer.providers import InitializeModelStageContext, LossContext

if TYPE_CHECKING:
    from d9d.trainer.planning.job_plan import JobPlan

__all__ = [
    "ActivationEstimate",
    "MemoryEstimate",
    "MemoryPlan",
    "estimate_activations",
    "estimate_memory",
    "plan_memory",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of persistent training state on one rank.

    Attributes:
        shard_factor: how many ranks share one copy of every parameter (pp × dp_shard × cp × tp).
        optimizer_states: optimizer tensors kept per trainable parameter (AdamW 2, SGD 1 or 0).
    """

    params: int
    grads: int
    optimizer: int
    shard_factor: int
    optimizer_states: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


def estimate_memory(
    param_bytes: int,
    trainable_bytes: int,
    *,
    pipeline_parallel: int,
    data_parallel_shard: int,
    context_parallel: int,
    tensor_parallel: int,
    optimizer_states: int,
) -> MemoryEstimate:
    """Per-rank parameter, gradient and optimizer bytes of a model of `param_bytes` (full size).

    Assumes what the built-in strategies do: pipeline stages split the layers evenly over pp, FSDP
    shards every parameter over dp_shard × cp (the cp ranks shard with dp_shard, as one axis),
    tensor parallelism splits every parameter over tp; dp_replicate keeps full copies, and experts
    count as dense parameters (expert parallelism is ignored). Gradients and optimizer states have
    the parameter's dtype and exist only for trainable parameters.
    """
    shard = pipeline_parallel * data_parallel_shard * context_parallel * tensor_parallel
    params = -(-param_bytes // shard)
    grads = -(-trainable_bytes // shard)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=grads * optimizer_states,
        shard_factor=shard,
        optimizer_states=optimizer_states,
    )


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one microbatch saves for backward on one rank, without and with the job's checkpointing.

    Attributes:
        plain: no activation checkpointing.
        checkpointed: with `trainer.activation_checkpointing` as configured (`plain` for `none`).
        full: with every block checkpointed.
        tokens: microbatch size × sequence length the forward ran on (this rank's share under cp).
    """

    plain: int
    checkpointed: int
    full: int
    tokens: str


@dataclass(frozen=True)
class MemoryPlan:
    """The memory estimate of a plan, per rank.

    Attributes:
        parameters: parameters of the whole model.
        param_bytes: bytes of the whole model's parameters (float32 master weights).
        trainable_bytes: bytes of its trainable parameters.
        state: parameters, gradients and optimizer state on one rank.
        activations: one microbatch's saved activations; None when they cannot be estimated.
        activations_note: why there is no activation estimate ("" when there is one).
    """

    parameters: int
    param_bytes: int
    trainable_bytes: int
    state: MemoryEstimate
    activations: ActivationEstimate | None
    activations_note: str

    @property
    def total(self) -> int:
        """The state plus the activations with the job's checkpointing (when estimated)."""
        return self.state.total + (self.activations.checkpointed if self.activations is not None else 0)


def plan_memory(job: ResolvedJob, plan: "JobPlan", context: DistributedContext) -> MemoryPlan:
    """Build this rank's stages on the meta device as the trainer will (refusing what it refuses),
    then estimate the memory of the whole model split by the plan's mesh.

    Raises:
        TrainingError: the model provider's parallelization left the job unable to run (e.g. a
            parallelism not applied, a renamed parameter), as the trainer refuses it.
        ParallelizeError: a parallelize function refused the model (e.g. no context-parallel support).
    """
    for stage in plan.stages:
        layout = plan.pipeline.layout if plan.pipeline is not None else None
        shape_model(job, context, plan.precision, layout=layout, stage=stage, data_vocab_size=plan.vocab_size)
    with torch.device("meta"):
        model = job.model_provider.initialize_model_stage(
            InitializeModelStageContext(
                context=context, precision=plan.precision, base_dir=job.loaded.base_dir
            )
        ).model
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    mesh = plan.mesh
    state = estimate_memory(
        param_bytes,
        trainable_bytes,
        pipeline_parallel=mesh.pipeline_parallel,
        data_parallel_shard=mesh.data_parallel_shard,
        context_parallel=mesh.context_parallel,
        tensor_parallel=mesh.tensor_parallel,
        optimizer_states=plan.optimizer_states.per_parameter,
    )
    activations, note = _activations(job, plan, context)
    return MemoryPlan(
        parameters=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        trainable_bytes=trainable_bytes,
        state=state,
        activations=activations,
        activations_note=note,
    )


def _activations(
    job: ResolvedJob, plan: "JobPlan", context: DistributedContext
) -> tuple[ActivationEstimate | None, str]:
    """The activation estimate, or None and why there is none."""
    sequence = plan.sequence
    if sequence.seq_len is None:
        return None, f"not estimated: pass --seq-len (the sequence length: {sequence.source})"
    if plan.batching is None:
        return None, "not estimated: the microbatch size is decided by a custom data provider"
    try:
        estimate = estimate_activations(
            job,
            context,
            seq_len=sequence.seq_len,
            microbatch_size=plan.batching.microbatch_size,
            precision=plan.precision,
        )
    except Exception as exc:  # a forward that cannot run on meta (e.g. MoE routing) is not an error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"not estimated: the forward does not run on the meta device ({first[:120]})"
    return estimate, ""


def estimate_activations(
    job: ResolvedJob,
    context: DistributedContext,
    *,
    seq_len: int,
    microbatch_size: int,
    precision: MixedPrecision,
) -> ActivationEstimate:
    """Run the task's loss on the meta device (no memory) and count what autograd saves for backward.

    The model is cast to the compute dtype (`precision.param_dtype`, as FSDP2 computes); blocks are the entries of the model's
    largest ModuleList/ModuleDict. `seq_len` is the dataset's full sequence length. Under context
    parallelism the model gets the context's cp group (`parallelize_context_parallel`; on a
    planning context a fake process group) and the forward runs rank 0's share of each sequence
    (seq_len / cp tokens), so everything is counted at that length except the K/V that attention
    all-gathers, which it keeps at the full length for backward. `F.scaled_dot_product_attention` is
    counted as the fused kernels on CUDA and CPU save it (q, k, v, output, float32 log-sum-exp), not
    as its math path, which the meta device would take (a float32 seq × seq matrix). Tensor
    parallelism divides activations by tp (sequence-parallel norms, split heads); a pipeline stage
    holds 1/pp of the layers but, with 1F1B, up to pp microbatches in flight, so pp leaves the
    figure as it is.

    Raises:
        Exception: whatever the model's forward raised on the meta device (e.g. data-dependent MoE
            routing), for the caller to report.
    """
    config = job.config.trainer.activation_checkpointing
    mesh = job.config.mesh
    with torch.device("meta"):
        base = job.model_provider.initialize_model_stage(
            InitializeModelStageContext(context=context, base_dir=job.loaded.base_dir, precision=precision)
        ).model
    base = base.to(precision.param_dtype)
    shape = (microbatch_size, seq_len)  # ids and labels are two tensors, as a dataset gives them
    batch: Any = {
        name: torch.zeros(shape, dtype=torch.long, device="meta") for name in ("input_ids", "labels")
    }
    if mesh.context_parallel > 1:
        batch = parallelize_context_parallel(base, context.mesh("dense")).shard_batch(batch)

    def measure(mode: str) -> int:
        model = copy.deepcopy(base)  # the cp group is shared, not copied
        if mode != "none":
            apply_activation_checkpointing(
                _blocks(model),
                ActivationCheckpointingConfig(mode=mode, every=config.every),  # type: ignore[arg-type]
            )

        def loss() -> object:
            return job.task.compute_loss(LossContext(model=model, batch=batch, device=torch.device("meta")))

        with _AttentionAsFusedKernel():
            saved = saved_activation_bytes(loss, exclude=model.parameters())
        return -(-saved // mesh.tensor_parallel)

    plain = measure("none")
    full = measure("full")
    checkpointed = {"none": plain, "full": full}.get(config.mode) or measure(config.mode)
    local = seq_len // mesh.context_parallel
    return ActivationEstimate(
        plain=plain, checkpointed=checkpointed, full=full, tokens=f"{microbatch_size} × {local}"
    )


class _FusedAttention(torch.autograd.Function):
    """Shapes only, for meta tensors: what the fused attention kernels save for backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        log_sum_exp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, log_sum_exp)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise NotImplementedError("only counts what a forward saves")


class _AttentionAsFusedKernel(TorchFunctionMode):
    """Under it `F.scaled_dot_product_attention` saves for backward what the fused kernels of CUDA and
    CPU save: q, k, v, output, log-sum-exp."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = {**dict(zip(("query", "key", "value"), args, strict=False)), **kwargs}
            return _FusedAttention.apply(named["query"], named["key"], named["value"])
        return func(*args, **kwargs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the largest ModuleList/ModuleDict (by parameters)."""
    containers = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict)]
    if not containers:
        return []
    best = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)
