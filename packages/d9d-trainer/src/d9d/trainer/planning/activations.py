"""One microbatch's saved activations, counted from a forward on the meta device.

The forward runs in the plan's compute dtype, with and without activation checkpointing, as the
trainer would shape the model (its provider's parallelisms on the rank's tensor-parallel group, the
rank's pipeline stages, one rank's share of the sequence under context parallelism). What the
autograd graph keeps saved for backward is counted by `d9d.parallel.saved_activation_bytes`, the
parameters (and so the weights' compute copies, `MemoryPlan.weight_copies`) left out.
"""

import copy
from typing import Any, cast

import msgspec
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from d9d.mesh import DistributedContext
from d9d.parallel import (
    ActivationCheckpointingConfig,
    CompileConfig,
    MixedPrecision,
    apply_activation_checkpointing,
    checkpointed_blocks,
    meta_attention_as,
    parallelize_context_parallel,
    recording_gathered_keys_values,
    saved_activation_bytes_among,
)
from d9d.parallel.pipeline import StageSpec
from d9d.trainer.build.model import applied_loss
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.planning.configured import packing_keys
from d9d.trainer.planning.plan import ActivationEstimate, PipelinePlan
from d9d.trainer.providers.model import InitializeModelStageContext, ParallelizeModelStageContext
from d9d.trainer.providers.task import LossContext, PipelineStageKwargs, PipelineTask, ShapesBatch

__all__ = ["estimate_activations"]


def estimate_activations(
    job: ResolvedJob,
    context: DistributedContext,
    *,
    seq_len: int,
    microbatch_size: int,
    precision: MixedPrecision,
    pipeline: "PipelinePlan | None" = None,
    stages: tuple[StageSpec, ...] | None = None,
    device: torch.device | str = "cuda",
) -> ActivationEstimate:
    """Run the task's loss on the meta device (no memory) and count what autograd saves for backward.

    The model is shaped by its provider on one process (adapters and frozen weights as the job
    trains them: a frozen weight's input is saved only where something before it trains) and cast to
    the compute dtype (`precision.param_dtype`, as FSDP2 computes); blocks are the entries of the
    model's largest ModuleList/ModuleDict. `seq_len` is the dataset's full sequence length. Under context
    parallelism the model gets the context's cp group (`parallelize_context_parallel`; on a
    planning context a fake process group) and the forward runs rank 0's share of each sequence
    (seq_len / cp tokens), so everything is counted at that length except the K/V that attention
    all-gathers, which it keeps at the full length for backward. That K/V is also counted apart (`ActivationEstimate.kv`,
    `kv_layer`). A packed dataset (`pack` or `document_masking` set) runs with `position_ids` and
    `document_ids`, so its document mask is counted as the device saves it. `F.scaled_dot_product_attention` is
    counted as the fused kernels on CUDA and CPU save it (q, k, v, output, float32 log-sum-exp), not
    as its math path, which the meta device would take (a float32 seq × seq matrix). The weights'
    compute copies are not activations (`MemoryPlan.weight_copies`). `mode: op` is counted as it runs.

    Under tensor or pipeline parallelism the model is built and parallelized by its provider as the
    rank's stages, on the rank's tensor-parallel group alone (`DistributedContext.tensor_parallel_view`:
    no FSDP, which needs real memory; the cp group as above), so what tensor parallelism splits and
    what it keeps whole (e.g. the embedding's output, the loss) is counted as it runs. Each stage runs the previous stage's output; the rank's figure adds each of its stages
    times the microbatches the schedule keeps in flight there (`_in_flight`). `stages`: the stages
    of the pp rank to count (default: this rank's, `pipeline.stages`). `device`: the device the job
    runs on; on "cpu" context parallelism's attention is counted as its CPU path runs it
    (`d9d.parallel.meta_attention_as`: each query chunk padded to a square).

    Raises:
        Exception: whatever the model's forward raised on the meta device (e.g. data-dependent MoE
            routing), for the caller to report.
    """
    config = job.config.trainer.activation_checkpointing
    mesh = job.config.mesh
    local = seq_len // mesh.context_parallel
    tokens = f"{microbatch_size} × {local}"
    if mesh.tensor_parallel > 1 or pipeline is not None:
        if pipeline is not None and stages is None:
            stages = pipeline.stages
        return _split_activations(
            job, context, seq_len, microbatch_size, precision, pipeline, tokens, stages or (None,), device
        )
    # shaped on one process (no FSDP, which needs real memory); the cp group is the context's, below
    one = context if context.is_local else DistributedContext.single_process()
    base = _shaped(job, one, precision, None, None, ActivationCheckpointingConfig())
    shape = (microbatch_size, seq_len)  # ids and labels are two tensors, as a dataset gives them
    batch = _meta_batch(job, shape)
    if mesh.context_parallel > 1:
        batch = parallelize_context_parallel(base, context.mesh("dense")).shard_batch(batch)

    def measure(mode: str) -> tuple[int, int]:
        model = copy.deepcopy(base)  # the cp group is shared, not copied
        if mode != "none":
            apply_activation_checkpointing(
                _blocks(model),
                ActivationCheckpointingConfig(mode=mode, every=config.every),  # type: ignore[arg-type]
            )

        def loss() -> object:
            return job.task.compute_loss(LossContext(model=model, batch=batch, device=torch.device("meta")))

        with _AttentionAsFusedKernel(device), recording_gathered_keys_values() as kv:
            return saved_activation_bytes_among(loss, among=kv, exclude=model.parameters())

    (plain, kv_plain), (full, _) = measure("none"), measure("full")
    checkpointed, kv = {"none": (plain, kv_plain), "full": (full, _)}.get(config.mode) or measure(config.mode)
    blocks = len(_blocks(base))
    recompute = _recompute(plain, checkpointed, blocks, config)
    return ActivationEstimate(
        plain=plain, checkpointed=checkpointed, full=full, tokens=tokens, recompute=recompute,
        kv=kv, kv_layer=kv_plain // max(blocks, 1),
    )  # fmt: skip


def _split_activations(
    job: ResolvedJob,
    context: DistributedContext,
    seq_len: int,
    microbatch_size: int,
    precision: MixedPrecision,
    pipeline: "PipelinePlan | None",
    tokens: str,
    stages: tuple[Any, ...],
    device: torch.device | str,
) -> ActivationEstimate:
    """`estimate_activations` under tensor or pipeline parallelism: a pp rank's `stages` (or (None,),
    the whole model) as its provider parallelizes them, on the view of this rank's tp group."""
    config = job.config
    ac = config.trainer.activation_checkpointing
    view = context.tensor_parallel_view()
    in_flight, note = _in_flight(pipeline, stages)
    shape = (microbatch_size, seq_len)
    full_batch = _meta_batch(job, shape)

    def measure(mode: str) -> list[tuple[int, int]]:
        """One microbatch's saved bytes of each stage."""
        models = [_shaped(job, view, precision, stage, pipeline, msgspec.structs.replace(ac, mode=mode))
                  for stage in stages]  # fmt: skip
        blocks[:] = [len(_blocks(model)) for model in models]
        batch = full_batch
        if config.mesh.context_parallel > 1:
            cp = [parallelize_context_parallel(model, context.mesh("dense")) for model in models][0]  # noqa: RUF015 (every stage gets the group)
            batch = cp.shard_batch(batch)
        if pipeline is None:
            (model,) = models

            def loss() -> object:
                return job.task.compute_loss(
                    LossContext(model=model, batch=batch, device=torch.device("meta"))
                )

            with _AttentionAsFusedKernel(device), recording_gathered_keys_values() as kv:
                return [saved_activation_bytes_among(loss, among=kv, exclude=model.parameters())]
        task = cast(PipelineTask, job.task)
        x, target = task.pipeline_inputs(batch)
        kwargs = dict(task.pipeline_kwargs(batch, models)) if isinstance(task, PipelineStageKwargs) else {}
        per_stage = []
        for model, stage in zip(models, stages, strict=True):
            if stage.index > 0:  # a stage receives the output of the stage before it (on any rank)
                x = _stage_input(job, view, precision, pipeline, stage.index - 1, batch)
            run_x = x

            def forward(model: nn.Module = model, stage: Any = stage, run_x: Any = run_x) -> object:
                out = model(run_x, **kwargs)  # e.g. labels: a fused head's loss (as the schedule runs it)
                return task.pipeline_loss(out, target) if stage.is_last else out

            with _AttentionAsFusedKernel(device), recording_gathered_keys_values() as kv:
                per_stage.append(saved_activation_bytes_among(forward, among=kv, exclude=model.parameters()))
        return per_stage

    blocks: list[int] = []
    plain, full = measure("none"), measure("full")
    checkpointed = {"none": plain, "full": full}.get(ac.mode) or measure(ac.mode)
    recompute = max(
        _recompute(p, c, n, ac) for (p, _), (c, _), n in zip(plain, checkpointed, blocks, strict=True)
    )

    def in_flight_total(per_stage: list[tuple[int, int]], part: int = 0) -> int:
        return sum(count * b[part] for count, b in zip(in_flight, per_stage, strict=True))

    kv_layer = max(p[1] // max(n, 1) for p, n in zip(plain, blocks, strict=True))
    return ActivationEstimate(
        plain=in_flight_total(plain), checkpointed=in_flight_total(checkpointed), full=in_flight_total(full),
        tokens=tokens, in_flight=in_flight, in_flight_note=note, recompute=recompute,
        kv=in_flight_total(checkpointed, 1), kv_layer=kv_layer,
    )  # fmt: skip


def _meta_batch(job: ResolvedJob, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A batch of `shape` on the meta device as the dataset gives it: ids and labels, and for packed
    rows (`pack` or `document_masking` set) the `position_ids` and `document_ids` of the document mask."""
    if isinstance(job.task, ShapesBatch):  # a task with microbatches of its own shape (`ShapesBatch`)
        return job.task.planning_batch(shape[0], shape[1], packed=bool(packing_keys(job)))
    names = ["input_ids", "labels"]
    if packing_keys(job):
        names += ["position_ids", "document_ids"]
    return {name: torch.zeros(shape, dtype=torch.long, device="meta") for name in names}


def _recompute(plain: int, checkpointed: int, blocks: int, config: ActivationCheckpointingConfig) -> int:
    """What one checkpointed block's backward holds recomputed on top of `checkpointed` (one
    microbatch of a stage of `blocks` blocks): the bytes its checkpointing saved, the mean over the
    blocks the mode checkpoints (`plain − checkpointed` is their sum; identical blocks, as a decoder's).
    0 where checkpointing spares nothing (e.g. `op` under tensor parallelism, which keeps the
    collectives' outputs too)."""
    count = len(checkpointed_blocks(blocks, config))
    return max(plain - checkpointed, 0) // count if count else 0


def _shaped(
    job: ResolvedJob,
    view: DistributedContext,
    precision: MixedPrecision,
    stage: Any,
    pipeline: "PipelinePlan | None",
    ac: Any,
) -> nn.Module:
    """One stage (or the whole model) on the meta device, parallelized by its provider on `view`, in
    the compute dtype."""
    where: dict[str, Any] = {
        "stage_index": stage.index if stage is not None else 0,
        "num_stages": pipeline.layout.num_stages if pipeline is not None else 1,
        "stage": stage,
        "base_dir": job.loaded.base_dir,
    }
    with torch.device("meta"):
        model = job.model_provider.initialize_model_stage(
            InitializeModelStageContext(context=view, precision=precision, **where)
        ).model
    job.model_provider.parallelize_model_stage(
        ParallelizeModelStageContext(
            context=view,
            model=model,
            precision=precision,
            activation_checkpointing=ac,
            compile=CompileConfig(),
            lora=job.config.peft.lora,
            loss=applied_loss(job)[0],
            **where,
        )
    )
    return model.to(precision.param_dtype)


def _stage_input(
    job: ResolvedJob,
    view: DistributedContext,
    precision: MixedPrecision,
    pipeline: "PipelinePlan | None",
    index: int,
    batch: Any,
) -> Any:
    """What stage `index + 1` receives: stage `index`'s output (run from the first stage, no grad),
    detached and requiring grad as the schedule hands it over."""
    assert pipeline is not None
    task = cast(PipelineTask, job.task)
    x, _ = task.pipeline_inputs(batch)
    with torch.no_grad():
        for stage in pipeline.layout.stages[: index + 1]:
            x = _shaped(job, view, precision, stage, pipeline, ActivationCheckpointingConfig())(x)
    return x.detach().requires_grad_(x.is_floating_point())


def _in_flight(pipeline: "PipelinePlan | None", stages: tuple[Any, ...]) -> tuple[tuple[int, ...], str]:
    """Per stage of `stages` (one pp rank's), the microbatches whose activations it holds at once, and how."""
    if pipeline is None:
        return (1,), ""
    schedule = pipeline.layout.config.schedule
    m, p = pipeline.microbatches_per_step, pipeline.layout.pp_size
    if schedule == "1f1b":
        counts = tuple(min(p - stage.index, m) for stage in stages)
        return counts, "1F1B: stage s holds min(pp − s, microbatches) forwards before its first backward"
    if schedule == "gpipe":
        return tuple(m for _ in stages), "GPipe: every microbatch's forward before any backward"
    return (
        tuple(m for _ in stages),
        f"{schedule}: an upper bound (every microbatch in flight on every stage); the schedule keeps fewer",
    )


class _AttentionAsFusedKernel(TorchFunctionMode):
    """Under it `F.scaled_dot_product_attention` runs as CPU's fused kernel, whose meta kernel gives the
    shapes: it saves for backward what the fused kernels of CUDA and CPU save (q, k, v, output,
    float32 log-sum-exp), and `op` checkpointing keeps its output and log-sum-exp, as theirs. On the
    meta device SDPA would take its math path (a float32 seq × seq matrix, saved and kept). Context
    parallelism's attention takes the path it takes on `device` (`meta_attention_as`). A masked call
    (packed rows) saves its mask too on a CPU, as a float mask of q's dtype; on CUDA the documents'
    FlexAttention saves what the fused kernels save and its block mask is O(blocks), not counted."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self._device_type = torch.device(device).type
        self._device_path = meta_attention_as(self._device_type)

    def __enter__(self) -> "_AttentionAsFusedKernel":
        self._device_path.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._device_path.__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = {**dict(zip(("query", "key", "value"), args, strict=False)), **kwargs}
            fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            q, k, v, mask = named["query"], named["key"], named["value"], named.get("attn_mask")
            if mask is None or self._device_type != "cpu":  # CUDA: FlexAttention, whose mask is O(blocks)
                return fused(q, k, v, is_causal=True)[0]
            # CPU: SDPA turns a boolean mask into one of q's dtype and saves it for backward
            float_mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, -torch.inf
            )
            return fused(q, k, v, attn_mask=float_mask)[0]
        return func(*args, **kwargs)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the largest ModuleList/ModuleDict (by parameters)."""
    containers = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict)]
    if not containers:
        return []
    best = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)
