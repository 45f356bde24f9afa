"""The per-rank memory estimate of a plan: persistent training state, and one microbatch's activations.

The state figure is a deliberately simple estimate (no temporary buffers, no allocator slack), see
`estimate_memory`, of the model the trainer shapes (every pipeline stage): its trainable parameters
(with LoRA, the adapters alone) are the ones with gradients and optimizer state. The activations are
counted from a forward on the meta device in the plan's compute dtype, with and without activation
checkpointing (`estimate_activations`). Under context parallelism that forward runs one rank's share
of the sequence with the planned cp group, as the trainer will. Building the model for it runs the
model provider and the trainer's checks of what it built (`d9d.trainer.build.model.shape_model`), so
a job the trainer would refuse is refused here too.
"""

from collections.abc import Iterable

import torch
from torch import nn

from d9d.mesh import DistributedContext
from d9d.parallel import (
    cast_once_parameters,
    describe_fused_loss,
    lora_coverage,
    select_float8_linears,
)
from d9d.parallel.pipeline import StageSpec, declared_ties
from d9d.trainer.build.model import applied_loss, shape_model
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.job.rules import shards_parameters
from d9d.trainer.planning.activations import estimate_activations
from d9d.trainer.planning.plan import (
    ActivationEstimate,
    JobPlan,
    MemoryEstimate,
    MemoryPlan,
    RankMemory,
    full_logits_path,
)
from d9d.trainer.providers.model import InitializeModelStageContext

__all__ = ["estimate_memory", "plan_memory"]


def estimate_memory(
    param_bytes: int,
    trainable_bytes: int,
    *,
    pipeline_parallel: int,
    data_parallel_shard: int,
    context_parallel: int,
    tensor_parallel: int,
    optimizer_states: int,
    state_bytes: int | None = None,
) -> MemoryEstimate:
    """Per-rank parameter, gradient and optimizer bytes of a model of `param_bytes` (full size).

    `state_bytes`: bytes of one optimizer state tensor over every trainable parameter (e.g. the
    trainable elements × 2 for bfloat16 states); None: `trainable_bytes`, states in the parameter's dtype.

    Assumes what the built-in strategies do: pipeline stages split the layers evenly over pp, FSDP
    shards every parameter over dp_shard × cp (the cp ranks shard with dp_shard, as one axis),
    tensor parallelism splits every parameter over tp; dp_replicate keeps full copies, and experts
    count as dense parameters (expert parallelism is ignored). Gradients have the parameter's dtype;
    they and the optimizer states exist only for trainable parameters.
    """
    shard = pipeline_parallel * data_parallel_shard * context_parallel * tensor_parallel
    state_bytes = trainable_bytes if state_bytes is None else state_bytes
    params = -(-param_bytes // shard)
    grads = -(-trainable_bytes // shard)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=-(-state_bytes // shard) * optimizer_states,
        shard_factor=shard,
        optimizer_states=optimizer_states,
        optimizer_state_bytes=state_bytes,
    )


def plan_memory(job: ResolvedJob, plan: JobPlan, context: DistributedContext) -> MemoryPlan:
    """Build the model on the meta device as the trainer will (refusing what it refuses), then estimate
    the memory of the whole model split by the plan's mesh, from the parameters that train in it, and
    under pipeline parallelism what each pp rank needs from its own stages (`RankMemory`).

    Raises:
        TrainingError: the model provider's parallelization left the job unable to run (e.g. a
            parallelism not applied, a renamed parameter), as the trainer refuses it.
        ParallelizeError: a parallelize function refused the model (e.g. no context-parallel support).
    """
    stages = _shaped_stages(job, plan, context)
    params = _whole_model_parameters(list(stages.values()))  # a DTensor counts its global size
    trainable = [p for p in params if p.requires_grad]  # with LoRA, the adapters alone
    state = _state(plan, params, plan.mesh.pipeline_parallel)
    offload = job.config.trainer.memory.cpu_offload
    activations, note = _activations(job, plan, context, plan.pipeline.stages if plan.pipeline else None)
    pp_size = plan.pipeline.layout.pp_size if plan.pipeline is not None else 0
    pp_ranks = tuple(_pp_rank(job, plan, context, r, stages, activations) for r in range(pp_size))
    float8, lora = job.config.trainer.precision.float8, job.config.peft.lora
    return MemoryPlan(
        float8=select_float8_linears(_unshaped(job, plan, context), float8) if float8 is not None else None,
        float8_all_gather=float8 is not None and float8.gathers_float8(shards_parameters(plan.mesh)),
        host_state=state.total if offload else 0,
        parameters=sum(p.numel() for p in params),
        param_bytes=_bytes(params),
        trainable_bytes=_bytes(trainable),
        trainable_parameters=sum(p.numel() for p in trainable),
        state=state,
        activations=activations,
        activations_note=note,
        lora=lora_coverage(list(stages.values()), lora) if lora is not None else None,
        pp_ranks=pp_ranks,
        loss=describe_fused_loss(*stages.values())
        or full_logits_path(fused=job.config.trainer.loss.fused, reason=applied_loss(job)[1]),
        weight_copies=_weight_copy_bytes(list(stages.values()), params, plan, plan.mesh.pipeline_parallel),
    )


def _pp_rank(
    job: ResolvedJob,
    plan: JobPlan,
    context: DistributedContext,
    pp_rank: int,
    shaped: dict[int, nn.Module],
    mine: ActivationEstimate | None,
) -> RankMemory:
    """What pp rank `pp_rank` needs: its stages' parameters (`shaped`, every stage's module) split over
    dp_shard × cp × tp, and their activations (`mine`, this rank's, when they are this rank's stages)."""
    assert plan.pipeline is not None
    stages = plan.pipeline.layout.stages_of_rank(pp_rank)
    modules = [shaped[stage.index] for stage in stages]
    return RankMemory(
        pp_rank=pp_rank,
        stages=stages,
        state=_state(plan, _parameters(modules), 1),
        activations=mine if stages == plan.pipeline.stages else _activations(job, plan, context, stages)[0],
        offloaded=job.config.trainer.memory.cpu_offload,
        weight_copies=_weight_copy_bytes(modules, _parameters(modules), plan, 1),
    )


def _bytes(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `modules` (one pp rank's stages), each tensor once."""
    return list({id(p): p for module in modules for p in module.parameters()}.values())


def _state(plan: JobPlan, params: list[nn.Parameter], pipeline_parallel: int) -> MemoryEstimate:
    """The per-rank state of `params` (global sizes) split over `pipeline_parallel` and the plan's
    dp_shard × cp × tp: the whole model's over pp, one pp rank's stages' over 1."""
    trainable = [p for p in params if p.requires_grad]
    states = plan.optimizer_states
    state_bytes = None  # the parameter's dtype
    if states.dtype is not None:
        state_bytes = sum(p.numel() for p in trainable) * states.dtype.itemsize
    mesh = plan.mesh
    return estimate_memory(
        _bytes(params),
        _bytes(trainable),
        pipeline_parallel=pipeline_parallel,
        data_parallel_shard=mesh.data_parallel_shard,
        context_parallel=mesh.context_parallel,
        tensor_parallel=mesh.tensor_parallel,
        optimizer_states=states.per_parameter,
        state_bytes=state_bytes,
    )


def _shaped_stages(job: ResolvedJob, plan: JobPlan, context: DistributedContext) -> dict[int, nn.Module]:
    """Every stage of the model by index (the whole model, index 0, without pp) on the meta device as
    the trainer shapes it (`shape_model`: adapters, frozen weights, parallelisms) and checks it; this
    rank's first, so what the trainer would refuse on this rank is refused first."""
    layout = plan.pipeline.layout if plan.pipeline is not None else None
    mine = {stage.index for stage in plan.stages if stage is not None}
    others = [stage for stage in layout.stages if stage.index not in mine] if layout is not None else []
    return {
        stage.index if stage is not None else 0: shape_model(
            job,
            context,
            plan.precision,
            layout=layout,
            stage=stage,
            data_vocab_size=plan.vocab_size,
            attention=plan.attention,
        )
        for stage in [*plan.stages, *others]
    }


def _weight_copy_bytes(
    stages: list[nn.Module], params: list[nn.Parameter], plan: JobPlan, pipeline_parallel: int
) -> int:
    """Per rank, the compute-dtype copies of the weights a step keeps (`MemoryPlan.weight_copies`): the
    parameters of `params` that `cast_once_parameters` names (under DDP every parameter: FSDP2's
    unsharded copies), split over `pipeline_parallel` × tp as `estimate_memory` splits the parameters
    (the whole model's over pp, one pp rank's stages' over 1)."""
    mesh, precision = plan.mesh, plan.precision
    if not precision.enabled or shards_parameters(mesh):
        return 0
    whole = {id(p): p for p in params}  # each tie once
    if mesh.data_parallel_replicate == 1:
        cast = {id(p) for stage in stages for p in cast_once_parameters(stage)}
        whole = {key: p for key, p in whole.items() if key in cast}
    elements = sum(p.numel() for p in whole.values())
    return -(-elements * precision.param_dtype.itemsize // (pipeline_parallel * mesh.tensor_parallel))


def _whole_model_parameters(stages: list[nn.Module]) -> list[nn.Parameter]:
    """The whole model's parameters over its stages: each name once, and each tie (the stages'
    `tied_parameters()`, e.g. an embedding table and the head that shares it) once."""
    by_name: dict[str, nn.Parameter] = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            by_name.setdefault(name, param)
    for tie in declared_ties(stages):
        for name in [name for name in tie if name in by_name][1:]:  # the first copy stands for the tie
            del by_name[name]
    return list({id(p): p for p in by_name.values()}.values())


def _unshaped(job: ResolvedJob, plan: JobPlan, context: DistributedContext) -> nn.Module:
    """The whole model as the provider initializes it, on the meta device (what float8 selects from)."""
    with torch.device("meta"):
        return job.model_provider.initialize_model_stage(
            InitializeModelStageContext(
                context=context, precision=plan.precision, base_dir=job.loaded.base_dir
            )
        ).model


def _activations(
    job: ResolvedJob, plan: JobPlan, context: DistributedContext, stages: tuple[StageSpec, ...] | None
) -> tuple[ActivationEstimate | None, str]:
    """The activation estimate of `stages` (one pp rank's; None: the whole model), or None and why
    there is none."""
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
            pipeline=plan.pipeline,
            stages=stages,
            device=plan.device,
        )
    except Exception as exc:  # a forward that cannot run on meta (e.g. MoE routing) is not an error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"not estimated: the forward does not run on the meta device ({first[:120]})"
    return estimate, ""
