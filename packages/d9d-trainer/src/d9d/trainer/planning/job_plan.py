"""`plan_job`: what a job will build on one rank, decided once, before any data or model exists.

The decisions are the trainer's: `Trainer` builds from the plan and `d9d plan` prints it, so a
config is accepted or refused by both with the same words. Every input is declared: the mesh and
config, the providers' optional abilities (`d9d.trainer.providers`: `ChecksMesh`,
`PipelineModelProvider`, `PipelineTask`, `DeclaresBatching`, `DeclaresOptimizerStates`) and, when
the trainer has built it, the dataset's `BuildDatasetResult` (its `seq_len` and `vocab_size`).
Nothing is probed, so a user's provider with the same declarations gets exactly a built-in's plan.
"""

from dataclasses import replace
from typing import Any

import torch

from d9d.mesh import DistributedContext, MeshConfig, axis_groups
from d9d.parallel import (
    AttentionKernel,
    MixedPrecision,
    SequenceShare,
    check_sequence_length,
    cuda_attention_facts,
    resolve_attention,
    resolve_precision,
)
from d9d.parallel.pipeline import PipelineConfig, PipelineLayout, pipeline_bubble, plan_pipeline
from d9d.trainer.errors import TrainingError
from d9d.trainer.job.load import LoadedJob
from d9d.trainer.job.resolve import ResolvedJob, resolve_job
from d9d.trainer.planning.configured import configured_value, packing_keys
from d9d.trainer.planning.memory import plan_memory
from d9d.trainer.planning.plan import JobPlan, PipelinePlan, SequencePlan
from d9d.trainer.providers.data import Batching, BuildDatasetResult, DeclaresBatching
from d9d.trainer.providers.model import (
    CheckSequenceLengthContext,
    ChecksMesh,
    ChecksSequenceLength,
    PipelineModelProvider,
)
from d9d.trainer.providers.optim import DeclaresOptimizerStates, OptimizerStates
from d9d.trainer.providers.task import PipelineTask

__all__ = [
    "ASSUMED_OPTIMIZER_STATES",
    "check_model_mesh",
    "configured_seq_len",
    "declared_batching",
    "pipeline_layout",
    "plan_config",
    "plan_job",
]

#: What the memory estimate assumes of an optimizer provider that declares no `optimizer_states()`.
ASSUMED_OPTIMIZER_STATES = 2


def plan_job(
    job: ResolvedJob,
    context: DistributedContext,
    *,
    dataset: BuildDatasetResult | None = None,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
    memory: bool = False,
) -> JobPlan:
    """The plan of `job` on `context`'s rank: every decision the trainer builds from, checked.

    Args:
        context: a real rank's context, or a planning one (`DistributedContext.for_planning`) of any size.
        dataset: the built training dataset (the trainer's), whose declared `seq_len` and
            `vocab_size` are planned with; None (`d9d plan`) takes the length from the config.
        seq_len: a length to plan with instead (`d9d plan --seq-len`); the dataset's own is still checked.
        device: the device to resolve the precision for (default: the context's).
        memory: also estimate the memory per rank, building the model on the meta device
            (`plan_memory`), which runs the model provider's code and the trainer's checks of it.

    Raises:
        TrainingError: the model provider refuses the mesh or the sequence length, or cannot run a
            pipeline.
        PipelineError: the schedule, stage, layer or microbatch counts do not fit.
        SequenceLengthError: context parallelism cannot cut the sequences.
        BatchSizeError: the declared batching does not split over the data-parallel ranks.
        ParallelizeError: the device, dtype, mesh or document mask cannot run `trainer.attention.backend`.
    """
    mesh = job.config.mesh
    check_model_mesh(job)
    batching = declared_batching(job, mesh)
    pipeline = _pipeline_plan(job, context, batching) if mesh.pipeline_parallel > 1 else None
    sequence = _sequence_plan(job, context, dataset, seq_len)
    if (
        dataset is None
    ):  # `d9d plan`: the eval set's length from the config (the trainer checks the built one)
        _check_eval_seq_len(job)
    device = torch.device(device) if device is not None else context.device
    precision = resolve_precision(job.config.trainer.precision, device)
    plan = JobPlan(
        mesh=mesh,
        rank=context.rank,
        device=device,
        precision=precision,
        batching=batching,
        pipeline=pipeline,
        sequence=sequence,
        vocab_size=dataset.vocab_size if dataset is not None else None,
        optimizer_states=_optimizer_states(job),
        attention=attention_kernel(job, device, precision, dataset),
    )
    return replace(plan, memory=plan_memory(job, plan, context)) if memory else plan


def plan_config(
    loaded: LoadedJob, *, seq_len: int | None = None, device: torch.device | str = "cuda"
) -> JobPlan:
    """The plan of rank 0 of a job config with its memory, on a context of its mesh's size (`d9d plan`).

    One process plans as the job runs (local mode); any other size on a planning context (a fake
    process group), opened and closed here, so no process group may exist around the call.

    Raises:
        D9dError: whatever the trainer refuses the job with, in its words (a provider that does not
            import, the model provider's check of the mesh, the pipeline layout, the batch split, the
            sequence length, what the provider builds).
    """
    job = resolve_job(loaded)  # imports the providers and checks their config sections
    mesh = job.config.mesh
    context = (
        DistributedContext.from_env(mesh, environ={}, device="cpu")
        if mesh.is_local
        else DistributedContext.for_planning(mesh)
    )
    with context as ctx:
        return plan_job(job, ctx, seq_len=seq_len, device=device, memory=True)


def check_model_mesh(job: ResolvedJob) -> None:
    """The model provider's own check of the mesh degrees (`ChecksMesh`), before anything runs.

    Raises:
        TrainingError: the provider refused the mesh (its message names the keys).
    """
    provider = job.model_provider
    if not isinstance(provider, ChecksMesh):
        return
    try:
        provider.check_mesh(job.config.mesh)
    except (ValueError, TypeError) as exc:
        raise TrainingError(str(exc)) from None


def declared_batching(job: ResolvedJob, mesh: MeshConfig) -> Batching | None:
    """The data provider factory's batching on `mesh` (`DeclaresBatching`), None when it declares none.

    Raises:
        BatchSizeError: the global batch does not split over the data-parallel ranks.
    """
    factory = job.data_factory
    return factory.batching(mesh) if isinstance(factory, DeclaresBatching) else None


# ---------------------------------------------------------------------------------------- pipeline


def pipeline_layout(job: ResolvedJob, n_microbatches: int) -> PipelineLayout:
    """The job's pipeline layout (what each rank builds and `d9d plan` shows).

    Raises:
        TrainingError: the model provider or the task cannot run a pipeline.
        PipelineError: the schedule, stage, layer or microbatch counts do not fit.
    """
    pcfg = job.config.pipelining
    provider = job.model_provider
    if not isinstance(provider, PipelineModelProvider):
        raise TrainingError(
            "mesh.pipeline_parallel > 1 needs a model provider with pipeline_num_layers() and stage "
            "support in initialize_model_stage (context.stage); see docs/parallelism.md"
        )
    if not isinstance(job.task, PipelineTask):
        raise TrainingError(
            "mesh.pipeline_parallel > 1 needs a task with pipeline_inputs() and pipeline_loss()"
        )
    return plan_pipeline(
        int(provider.pipeline_num_layers()),
        job.config.mesh.pipeline_parallel,
        PipelineConfig(pcfg.schedule, pcfg.stages_per_rank),
        embedding_weight=pcfg.embedding_weight,
        head_weight=pcfg.head_weight,
        n_microbatches=n_microbatches,
    )


def _pipeline_plan(job: ResolvedJob, context: DistributedContext, batching: Batching | None) -> PipelinePlan:
    """The pipeline plan for mesh.pipeline_parallel > 1: its layout, this rank's stages, the bubble.

    Single-stage schedules (gpipe, 1f1b) give one stage per rank; the multi-stage ones
    (`pipelining.stages_per_rank`, V-shaped for zbv and dualpipev) several, built as separate chunks.
    """
    if batching is None:
        raise TrainingError(
            f"mesh.pipeline_parallel > 1 needs to know the microbatches per step before anything is "
            f"built, but providers.data ({job.config.providers.data}) declares no batching; give the "
            "data provider factory a batching(mesh) method returning d9d.trainer.providers.Batching (see "
            "docs/parallelism.md) or use the built-in d9d.trainer:AutoDataProviderFactory"
        )
    m = batching.microbatches_per_step
    layout = pipeline_layout(job, m)
    mesh = job.config.mesh
    groups = axis_groups(mesh, "dense", "pp")
    pp_ranks = tuple(tuple(sorted(g[r] for g in groups)) for r in range(layout.pp_size))
    return PipelinePlan(
        layout=layout,
        stages=layout.stages_of_rank(context.coordinate("pp")),
        microbatches_per_step=m,
        bubble=pipeline_bubble(layout.config.schedule, layout.pp_size, layout.stages_per_rank, m),
        pp_ranks=pp_ranks,
    )


# ---------------------------------------------------------------------------------------- sequence

#: How each source of the sequence length is named in the context-parallel refusal, and its fix.
_DATASET_LENGTH = ("the dataset's sequences have", "set the dataset's seq_len (e.g. dataset.seq_len) to")
_OPTION_LENGTH = ("--seq-len gives", "pass")


def _sequence_plan(
    job: ResolvedJob, context: DistributedContext, dataset: BuildDatasetResult | None, seq_len: int | None
) -> SequencePlan:
    """The sequence length (the option's, else the dataset's), each source checked against cp."""
    mesh = job.config.mesh
    cp = mesh.context_parallel
    if dataset is not None:
        length, source = dataset.seq_len, f"providers.dataset ({job.config.providers.dataset})"
        if length is None:
            source = "the dataset declares none (BuildDatasetResult.seq_len)"
    else:
        length, source = configured_seq_len(job, "dataset")
    lengths = [(length, source, _DATASET_LENGTH)] if length is not None else []
    if seq_len is not None:
        lengths.append((seq_len, "--seq-len", _OPTION_LENGTH))
        length, source = seq_len, "--seq-len"
    provider = job.model_provider
    for each, where, (subject, fix) in lengths:  # the dataset's own length is checked under --seq-len too
        check_sequence_length(each, cp, subject=subject, fix=fix)
        if isinstance(provider, ChecksSequenceLength):
            try:
                provider.check_sequence_length(CheckSequenceLengthContext(each, job.loaded.base_dir))
            except (ValueError, TypeError) as exc:
                raise TrainingError(f"{exc} (the sequence length: {each} from {where})") from None
    groups = tuple(tuple(g) for g in axis_groups(mesh, "batch", "cp"))
    share = SequenceShare(length, cp, context.coordinate("cp")) if length is not None else None
    packed = dataset.document_masking if dataset is not None else bool(packing_keys(job))
    return SequencePlan(seq_len=length, source=source, cp_groups=groups, share=share, packed=bool(packed))


def attention_kernel(
    job: ResolvedJob, device: torch.device, precision: MixedPrecision, dataset: BuildDatasetResult | None
) -> AttentionKernel:
    """`trainer.attention.backend` on `device` in the compute dtype (`auto` decided from the CUDA device's
    capability when there is one), for the built dataset's document masking (`d9d plan`: the config's).

    Raises:
        ParallelizeError: the kernel cannot run there (one line: why, and what to use).
    """
    capability, cudnn_version = cuda_attention_facts(device)
    masking = dataset.document_masking if dataset is not None else bool(packing_keys(job))
    return resolve_attention(
        job.config.trainer.attention,
        device,
        precision.param_dtype,
        capability=capability,
        cudnn_version=cudnn_version,
        document_masking=bool(masking),
        context_parallel=job.config.mesh.context_parallel,
    )


#: Where the eval set's length is refused from (the trainer's `load_eval_set` says the same).
EVAL_LENGTH = ("eval_dataset: the eval set's sequences have", "set eval_dataset.seq_len to")


def _check_eval_seq_len(job: ResolvedJob) -> None:
    """The eval set's length from the config (when it gives one) against cp, as the trainer refuses it."""
    if job.config.eval is None:
        return
    length, _ = configured_seq_len(job, "eval_dataset")
    if length is not None:
        check_sequence_length(
            length, job.config.mesh.context_parallel, subject=EVAL_LENGTH[0], fix=EVAL_LENGTH[1]
        )


def configured_seq_len(job: ResolvedJob, role: str = "dataset") -> tuple[int | None, str]:
    """A dataset's sequence length as far as the config tells it without loading data, and from where.

    `role` is "dataset" or "eval_dataset": the `seq_len` key of that section when the config sets it,
    else the default of that key in its provider's `config_type`; (None, why) when neither exists.
    """
    value, source = configured_value(job, role, "seq_len")
    if _is_length(value):
        return value, source
    return None, f"neither {role}.seq_len nor the {role} provider's config_type gives it"


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------- optimizer


def _optimizer_states(job: ResolvedJob) -> OptimizerStates:
    """The optimizer provider's declared state per parameter, or the assumption (AdamW-like)."""
    provider = job.optimizer_provider
    if isinstance(provider, DeclaresOptimizerStates):
        return provider.optimizer_states()
    spec = job.config.providers.optimizer
    return OptimizerStates(
        ASSUMED_OPTIMIZER_STATES,
        f"assumed AdamW-like, {ASSUMED_OPTIMIZER_STATES} states per parameter: {spec} is a custom "
        "optimizer that declares none (optimizer_states())",
    )
