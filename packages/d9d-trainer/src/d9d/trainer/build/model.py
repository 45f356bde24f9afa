"""Building a job's model: initialize on the meta device, shape it for training (parallelisms,
activation checkpointing, compile) and check what the provider built (`shape_model`, which `d9d plan`
runs too), then materialize and initialize it identically on any mesh (`materialize_model`), leaving
what the starting weights fill allocated but not initialized."""

from typing import Any

import msgspec
import torch
from torch import nn

from d9d.mesh import D9dError, DistributedContext, first_line
from d9d.parallel import (
    AttentionKernel,
    Float8Config,
    LoraConfig,
    LossConfig,
    MixedPrecision,
    apply_float8,
    cast_linears_once,
    context_parallel_of,
    fsdp_parameters,
    lora_parameters,
)
from d9d.parallel.pipeline import (
    ZERO_BUBBLE_SCHEDULES,
    PipelineLayout,
    StageSpec,
    zero_bubble_custom_function_problem,
)
from d9d.trainer.build.materialize import materialize_and_initialize
from d9d.trainer.build.starting_weights import imported_keys
from d9d.trainer.errors import OutOfMemoryError, TrainingError, is_out_of_memory
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.job.rules import shards_parameters
from d9d.trainer.providers.model import InitializeModelStageContext, ParallelizeModelStageContext

__all__ = [
    "check_lora_applied",
    "check_offload_applied",
    "check_parallelisms_applied",
    "check_vocabulary",
    "materialize_model",
    "shape_model",
]


#: Mesh degree → (the axis whose DTensor parameters prove the provider applied it, what applies it).
_APPLIED_BY = {
    "tensor_parallel": ("tp", "d9d.parallel.parallelize_tensor_parallel"),
    "data_parallel_shard": ("dp_shard", "d9d.parallel.parallelize_hsdp"),
    "data_parallel_replicate": ("dp_replicate", "d9d.parallel.parallelize_hsdp"),
    "expert_parallel": ("ep_shard", "d9d.parallel.expert.parallelize_expert_parallel"),
    "context_parallel": ("cp", "d9d.parallel.parallelize_hsdp, which shards over dp_shard × cp"),
}


def check_parallelisms_applied(model: nn.Module, mesh_degrees: dict[str, int]) -> None:
    """Every degree > 1 must have left some parameter distributed over its axis.

    Otherwise the ranks of that axis silently compute copies (tensor parallel) or train without
    synchronizing their gradients (data parallel).

    Raises:
        TrainingError: naming the degree, what the provider should call, or the degree to set to 1.
    """
    from torch.distributed.tensor import DTensor

    seen: set[str] = set()
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            for index, name in enumerate(mesh.mesh_dim_names or ()):
                if mesh.size(index) > 1:
                    seen.add(name)
    for key, (axis, how) in _APPLIED_BY.items():
        degree = mesh_degrees.get(key, 1)
        if degree > 1 and not any(axis in name for name in seen):  # flattened names contain it
            raise TrainingError(
                f"mesh.{key}={degree} but the model provider's parallelize_model_stage left no parameter "
                f"distributed over it, so those ranks would not work together; apply it there ({how}) "
                f"or set mesh.{key}: 1"
            )


def _apply_float8(
    model: nn.Module, float8: Float8Config, job: ResolvedJob, context: DistributedContext
) -> None:
    """Float8 linears, before the provider's parallelisms (FSDP gathers them in float8 when tensorwise);
    the config loader refuses what float8 does not work with yet (tensor parallelism, LoRA)."""
    sharded = not context.is_local and shards_parameters(job.config.mesh)
    apply_float8(model, float8, fsdp_float8_all_gather=sharded)


def check_lora_applied(model: nn.Module, lora: LoraConfig | None) -> None:
    """A configured `peft.lora` must have left at least one adapter on the model (stage).

    Otherwise the provider ignored it and the job would train (and export) the full model.

    Raises:
        TrainingError: naming the key and the call the provider should make.
    """
    if lora is not None and not lora_parameters(model):
        raise TrainingError(
            "peft.lora is set but the model provider's parallelize_model_stage applied no adapters; "
            "call d9d.parallel.apply_lora(model, context.lora) there"
        )


def check_offload_applied(model: nn.Module, cpu_offload: bool) -> None:
    """`trainer.memory.cpu_offload` must have left every FSDP2 parameter of the model (stage) on the host.

    Otherwise the provider ignored it and the job would keep its whole state on the device.

    Raises:
        TrainingError: naming the key, how many parameters stayed, and the call the provider should make.
    """
    if not cpu_offload:
        return
    managed = fsdp_parameters(model)
    kept = fsdp_parameters(model, offloaded=False)
    if managed and not kept:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    example = f" (e.g. {names.get(id(kept[0]), '?')!r})" if kept else ""
    raise TrainingError(
        f"trainer.memory.cpu_offload is set but the model provider's parallelize_model_stage left "
        f"{len(kept) if managed else 'every one'} of {len(managed) or len(names)} parameters{example} in FSDP "
        "units without CPU offload; pass cpu_offload=context.cpu_offload to d9d.parallel.parallelize_hsdp "
        "there or set trainer.memory.cpu_offload: false"
    )


def materialize_model(job: ResolvedJob, context: DistributedContext, model: nn.Module) -> nn.Module:
    """Allocate a shaped model (`shape_model`) on the rank's device and initialize it identically on any mesh.

    What the provider's import folder fills (`imported_keys`: on a fresh run the folder, on a resume the
    checkpoint) is allocated, this rank's shard of it, and not initialized, so a rank never holds more
    than its shard of the model plus one module of what is initialized (rotary tables, LoRA adapters).

    Raises:
        OutOfMemoryError: the rank's share of the model does not fit on its device.
    """
    determinism = job.config.trainer.determinism
    init_device = "cpu" if determinism.init_device == "cpu" else context.device
    loaded = imported_keys(job, context, model)
    try:
        materialize_and_initialize(
            model, context.device, determinism.seed, init_device=init_device, loaded=loaded
        )
        # What runs before the first step draws from the seed too, so a job gives the same numbers in a
        # fresh process, a notebook or a forked test; each step re-seeds per rank and microbatch
        # (d9d.trainer.step.randomness).
        torch.manual_seed(determinism.seed)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        n = sum(p.numel() for p in model.parameters())
        raise OutOfMemoryError(
            f"the model ({n:,} parameters on this rank) does not fit in {context.device} memory ({first_line(exc)}); "
            "make it smaller or split it over more ranks (mesh.data_parallel_shard, mesh.tensor_parallel, "
            "mesh.pipeline_parallel)"
        ) from None
    return model


def shape_model(
    job: ResolvedJob,
    context: DistributedContext,
    precision: MixedPrecision,
    *,
    layout: PipelineLayout | None = None,
    stage: StageSpec | None = None,
    data_vocab_size: int | None = None,
    attention: AttentionKernel | None = None,
) -> nn.Module:
    """This rank's model (stage) on the meta device, parallelized by its provider and checked.

    `data_vocab_size` (the dataset's vocabulary, when it declares one) is checked against the model's
    input embedding first, so ids the embedding cannot look up fail before anything is written. On a
    planning context (`d9d plan`) the same checks refuse what the trainer would. `attention` (the
    plan's kernel) reaches both provider calls.

    Raises:
        TrainingError: the provider's parallelization left a mesh degree unapplied, gave no module
            the cp group, applied no LoRA adapters, ignored `trainer.memory.cpu_offload`, or renamed parameters (`torch.compile(module)`
            wraps it as `_orig_mod`), which would change every checkpoint and export key.
    """
    import torch

    where: dict[str, Any] = {
        "stage_index": stage.index if stage is not None else 0,
        "num_stages": layout.num_stages if layout is not None else 1,
        "stage": stage,
        "base_dir": job.loaded.base_dir,
        "attention": attention,
    }
    with torch.device("meta"):
        model = job.model_provider.initialize_model_stage(
            InitializeModelStageContext(context=context, precision=precision, **where)
        ).model
    if data_vocab_size is not None:
        check_vocabulary(model, data_vocab_size, model_section=job.sections.get("model"),
                         dataset_section=job.sections.get("dataset"))  # fmt: skip
    float8 = job.config.trainer.precision.float8
    if float8 is not None:
        _apply_float8(model, float8, job, context)
    _parallelize(job, context, precision, model, where)
    _check_shaped(job, context, model)
    if precision.enabled:  # the linears read their compute copies cast once per step (the step's scope)
        cast_linears_once(model)
    return model


def _parallelize(
    job: ResolvedJob, context: DistributedContext, precision: MixedPrecision, model: nn.Module,
    where: dict[str, Any],
) -> None:  # fmt: skip
    """The model provider's `parallelize_model_stage`, with the job's training settings."""
    tcfg = job.config.trainer
    try:
        job.model_provider.parallelize_model_stage(
            ParallelizeModelStageContext(
                context=context,
                model=model,
                precision=precision,
                activation_checkpointing=tcfg.activation_checkpointing,
                compile=tcfg.compile,
                lora=job.config.peft.lora,
                cpu_offload=tcfg.memory.cpu_offload,
                loss=applied_loss(job)[0],
                **where,
            )
        )
    except D9dError as exc:
        if context.is_local and "no device mesh in local mode" in str(exc):
            raise TrainingError(
                "the model provider's parallelize_model_stage asked for a device mesh on one process: it "
                "is called on every mesh now; pass context.mesh (None on one process) to parallelize_hsdp "
                "instead of context.context.mesh('dense'), or check context.context.is_local"
            ) from exc
        raise


def applied_loss(job: ResolvedJob) -> tuple[LossConfig, str | None]:
    """`trainer.loss` as the trainer applies it, and why it differs from the config (None when it
    does not): under a zero-bubble pipeline schedule on a torch whose weight-gradient pass cannot run
    through a custom autograd Function (torch 2.11), the head returns full logits instead of fusing."""
    config = job.config
    loss = config.trainer.loss
    zero_bubble = config.mesh.pipeline_parallel > 1 and config.pipelining.schedule in ZERO_BUBBLE_SCHEDULES
    problem = zero_bubble_custom_function_problem() if loss.fused and zero_bubble else None
    if problem is None:
        return loss, None
    return msgspec.structs.replace(loss, fused=False), f"{problem} through the fused head (torch 2.15 can)"


def _check_shaped(job: ResolvedJob, context: DistributedContext, model: nn.Module) -> None:
    """What the provider's parallelization must have done: LoRA, offload and every mesh degree applied,
    the cp group handed to the attention, and the parameter names kept."""
    config = job.config
    check_lora_applied(model, config.peft.lora)
    if not context.is_local:
        check_offload_applied(model, config.trainer.memory.cpu_offload)
        mesh = config.mesh
        check_parallelisms_applied(
            model,
            {
                "tensor_parallel": mesh.tensor_parallel,
                "data_parallel_shard": mesh.data_parallel_shard,
                "data_parallel_replicate": mesh.data_parallel_replicate,
                "expert_parallel": mesh.expert_parallel if _has_experts(model) else 1,
                "context_parallel": mesh.context_parallel,
            },
        )
        if mesh.context_parallel > 1 and context_parallel_of(model) is None:
            raise TrainingError(
                f"mesh.context_parallel={mesh.context_parallel} but the model provider's parallelize_model_stage "
                "gave no module the cp group, so every cp rank would attend only to its own part of the "
                "sequence; call d9d.parallel.parallelize_context_parallel(model, context.mesh) there (the "
                "model's attention must support it: see docs/parallelism.md) or set mesh.context_parallel: 1"
            )
    renamed = [name for name, _ in model.named_parameters() if "_orig_mod." in name]
    if renamed:
        raise TrainingError(
            f"the model provider's parallelize_model_stage renamed parameters (e.g. {renamed[0]!r}): "
            "torch.compile(module) wraps the module; compile in place with module.compile() or "
            "d9d.parallel.compile_blocks so checkpoint and export keys stay the same"
        )


def check_vocabulary(
    model: nn.Module, data_vocab_size: int, *, model_section: Any = None, dataset_section: Any = None
) -> None:
    """The model's input embedding must have a row for every id of the data's vocabulary.

    The embedding is `model.get_input_embeddings()` when the model has that method (Hugging Face's
    convention), else its first `nn.Embedding`; a stage without one (a later pipeline stage) passes.
    The sections (the job's `model:` and `dataset:`, as constructed) shape the fix the error gives: a
    `vocab_size` key to raise, or the folder whose config.json sets it and the `dataset.tokenizer`
    that made the data.

    Raises:
        TrainingError: naming both sizes and the fix.
    """
    embedding: Any = None
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        embedding = getter()
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None or embedding.num_embeddings >= data_vocab_size:
        return
    rows = embedding.num_embeddings
    tokenizer = getattr(dataset_section, "tokenizer", None)
    source = f" (dataset.tokenizer: {tokenizer})" if isinstance(tokenizer, str) else ""
    folder = next(
        (v for k in ("hf_folder", "folder") if isinstance(v := getattr(model_section, k, None), str)), None
    )
    if hasattr(model_section, "vocab_size") or folder is None:
        fix = (
            f"raise the model's vocabulary size (e.g. model.vocab_size: {data_vocab_size}) or use data "
            "tokenized for this model"
        )
    else:
        fix = (
            f"the model's vocabulary is vocab_size in {folder}/config.json; use the tokenizer that came "
            "with that model (dataset.tokenizer) or a model folder whose vocabulary covers this tokenizer's"
        )
    raise TrainingError(
        f"the data's token ids go up to {data_vocab_size - 1} (a vocabulary of {data_vocab_size}{source}) "
        f"but the model's input embedding has {rows} rows; {fix}"
    )


def _has_experts(model: nn.Module) -> bool:
    from d9d.parallel.expert import MoE

    return any(isinstance(m, MoE) for m in model.modules())
