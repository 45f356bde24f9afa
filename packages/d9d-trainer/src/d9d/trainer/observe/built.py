"""The "job built" line: what this rank built, once, before the first step (mesh, parameters and the
trainable ones, precision, the memory levers in effect, the attention kernel and why, what the LoRA
patterns matched, and the model provider's own account), and a warning line when the LoRA patterns look like they miss projections."""

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from d9d.mesh import DistributedContext, get_logger
from d9d.parallel import (
    LoraCoverage,
    describe_fused_loss,
    fsdp_parameters,
    lora_coverage,
    select_float8_linears,
)
from d9d.trainer.build.model import applied_loss
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.planning.plan import JobPlan, full_logits_path
from d9d.trainer.providers.model import DescribesModel

__all__ = ["log_job_built"]

_log = get_logger("d9d.trainer")


def log_job_built(
    job: ResolvedJob, ctx: DistributedContext, plan: JobPlan, model: torch.nn.Module, *, cpu_threads: int,
    run_dir: Path,
) -> None:  # fmt: skip
    """Log "job built" on every rank, with only the fields that say more than the ones before them."""
    tcfg = job.config.trainer
    provider = job.model_provider
    described = dict(provider.describe_model()) if isinstance(provider, DescribesModel) else {}
    params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    local_params = sum(_local_numel(p) for p in model.parameters())
    lora = job.config.peft.lora
    coverage = lora_coverage(model, lora, whole_model=plan.pipeline is None) if lora is not None else None
    optional: dict[str, Any] = {
        "local_params": local_params if local_params != params else None,
        "device_name": ctx.device_name if ctx.device_name != str(ctx.device) else None,
        "cpu_threads": cpu_threads if ctx.device.type == "cpu" else None,
        "activation_checkpointing": (
            tcfg.activation_checkpointing.mode if tcfg.activation_checkpointing.mode != "none" else None
        ),
        "lora_targets": coverage.describe() if coverage is not None else None,
        "compile": True if tcfg.compile.enabled else None,
        "cpu_offload": _offload_note(model, ctx.device) if tcfg.memory.cpu_offload else None,
        "attention": plan.attention.brief() if plan.attention is not None else None,
        "float8": (
            select_float8_linears(model, tcfg.precision.float8).describe()
            if tcfg.precision.float8 is not None
            else None
        ),
        "loss": _loss_path(model, plan, fused=tcfg.loss.fused, reason=applied_loss(job)[1]),
    }
    _log.info(
        "job built",
        run_dir=str(run_dir.resolve()),
        mesh=job.config.mesh.describe_degrees(),
        microbatches_per_step=plan.batching.microbatches_per_step if plan.batching is not None else None,
        params=params,
        **({"trainable_params": trainable} if trainable != params else {}),  # with LoRA: the adapters
        device=str(ctx.device),
        precision=plan.precision.describe(),
        **{key: value for key, value in optional.items() if value is not None},
        **described,  # the model provider's own account (e.g. which backend built the model)
    )
    if coverage is not None:
        _warn_lora_coverage(coverage, ctx)


def _warn_lora_coverage(coverage: LoraCoverage, ctx: DistributedContext) -> None:
    """The LoRA patterns' warning, once per pipeline stage: on the ranks whose other coordinates are 0."""
    warning = coverage.warning()
    coordinates = {} if ctx.is_local else ctx.coordinates["dense"]
    if warning is not None and not any(v for axis, v in coordinates.items() if axis != "pp"):
        _log.warning(warning)


def _loss_path(model: torch.nn.Module, plan: JobPlan, *, fused: bool, reason: str | None) -> str | None:
    """The full logits and why, where this rank's loss runs on them; None where it runs fused (the
    default, `trainer.loss`: `d9d plan` says it) or on another rank (a pipeline without the last stage)."""
    if describe_fused_loss(model) is not None or not any(s is None or s.is_last for s in plan.stages):
        return None
    return full_logits_path(fused=fused, reason=reason)


def _local_numel(param: torch.Tensor) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _offload_note(model: torch.nn.Module, device: torch.device) -> str:
    """What `trainer.memory.cpu_offload` keeps on the host, for the "job built" line."""
    host = fsdp_parameters(model, offloaded=True)
    size = sum(_local_numel(p) * p.element_size() for p in host)
    pinned = "pinned " if device.type == "cuda" else ""
    nothing = "" if device.type == "cuda" else "; a CPU run has no device to offload from"
    return f"{len(host)} parameters ({size:,} bytes on this rank), their gradients and optimizer state in {pinned}host memory{nothing}"
