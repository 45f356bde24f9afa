"""`d9d plan`: validate a job for a launch size without GPUs and print what it would run.

The memory figure is a deliberately simple estimate of the persistent training state per rank (no
temporary buffers, no allocator slack), see `estimate_memory`, plus the activations one microbatch
keeps for backward, counted from a forward on the meta device (`estimate_activations`) in the job's
compute dtype, with and without activation checkpointing.
"""

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.commands._text import format_size
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.trainer import OptimizerConfig, ResolvedJob

__all__ = [
    "ActivationEstimate",
    "MemoryEstimate",
    "estimate_activations",
    "estimate_memory",
    "launch_command",
    "plan",
]

#: Import path of the built-in data provider whose batching `plan` can report.
_AUTO_DATA = "d9d.trainer:AutoDataProviderFactory"
_BUILTIN_OPTIMIZER = "d9d.trainer:BuiltinOptimizerProvider"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of persistent training state on one rank.

    Attributes:
        shard_factor: how many ranks share one copy of every parameter (pp × dp_shard × tp).
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
    tensor_parallel: int,
    optimizer_states: int,
) -> MemoryEstimate:
    """Per-rank parameter, gradient and optimizer bytes of a model of `param_bytes` (full size).

    Assumes what the built-in strategies do: pipeline stages split the layers evenly over pp, FSDP
    shards every parameter over dp_shard, tensor parallelism splits every parameter over tp;
    dp_replicate and cp keep full copies, and experts count as dense parameters (expert parallelism
    is ignored). Gradients and optimizer states have the parameter's dtype and exist only for
    trainable parameters.
    """
    shard = pipeline_parallel * data_parallel_shard * tensor_parallel
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
        tokens: microbatch size × sequence length the forward ran on.
    """

    plain: int
    checkpointed: int
    full: int
    tokens: str


def estimate_activations(
    job: "ResolvedJob", *, seq_len: int, microbatch_size: int, param_dtype: str, tensor_parallel: int
) -> ActivationEstimate:
    """Run the task's loss on the meta device (no memory) and count what autograd saves for backward.

    The model is cast to `param_dtype` (as FSDP2 computes); blocks are the entries of the model's
    largest ModuleList/ModuleDict. Tensor parallelism divides activations by tp (sequence-parallel
    norms, split heads); a pipeline stage holds 1/pp of the layers but, with 1F1B, up to pp
    microbatches in flight, so pp leaves the figure as it is.

    Raises:
        Exception: whatever the model's forward raised on the meta device (e.g. data-dependent MoE
            routing), for the caller to report.
    """
    import copy

    import torch

    from d9d.mesh import DistributedContext
    from d9d.parallel import (
        ActivationCheckpointingConfig,
        apply_activation_checkpointing,
        saved_activation_bytes,
    )
    from d9d.trainer import InitializeModelStageContext, LossContext

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[param_dtype]
    config = job.config.trainer.activation_checkpointing
    with DistributedContext.for_planning(job.config.mesh) as ctx, torch.device("meta"):
        base = job.model_provider.initialize_model_stage(InitializeModelStageContext(context=ctx)).model
    base = base.to(dtype)
    ids = torch.zeros((microbatch_size, seq_len), dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids}

    def measure(mode: str) -> int:
        model = copy.deepcopy(base)
        if mode != "none":
            blocks = _blocks(model)
            apply_activation_checkpointing(
                blocks, ActivationCheckpointingConfig(mode=mode, every=config.every)
            )  # type: ignore[arg-type]

        def loss() -> object:
            return job.task.compute_loss(LossContext(model=model, batch=batch, device=torch.device("meta")))

        return -(-saved_activation_bytes(loss, exclude=model.parameters()) // tensor_parallel)

    plain = measure("none")
    full = measure("full")
    checkpointed = {"none": plain, "full": full}.get(config.mode) or measure(config.mode)
    return ActivationEstimate(
        plain=plain, checkpointed=checkpointed, full=full, tokens=f"{microbatch_size} × {seq_len}"
    )


def _blocks(model: "object") -> list["object"]:
    """The transformer blocks: the entries of the largest ModuleList/ModuleDict (by parameters)."""
    from torch import nn

    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]  # type: ignore[attr-defined]
    if not containers:
        return []
    best = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)


def launch_command(config: str, overrides: Sequence[str], *, nnodes: int, nproc_per_node: int) -> str:
    """The shell command that launches `d9d train` for this many nodes and processes per node.

    One process in all is a plain `d9d train`; several nodes rendezvous at node 0 (fill in its host).
    """
    args = [config]
    for item in overrides:
        args += ["--set", item]
    job = " ".join(shlex.quote(part) for part in args)
    if nnodes * nproc_per_node == 1:
        return f"d9d train {job}"
    if nnodes == 1:
        return f"torchrun --nproc-per-node {nproc_per_node} -m d9d.cli train {job}"
    return (
        f"torchrun --nnodes {nnodes} --nproc-per-node {nproc_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint HOST_OF_NODE_0:29500 -m d9d.cli train {job}"
    )


def _launch_shape(
    world_size: int | None, nnodes: int | None, nproc_per_node: int | None
) -> tuple[int, int] | None:
    """(nodes, processes per node) asked for on the command line, or None for "what the mesh needs"."""
    if world_size is not None and (nnodes is not None or nproc_per_node is not None):
        raise click.UsageError("give either --world-size or --nnodes/--nproc-per-node, not both")
    if world_size is not None:
        return 1, world_size
    if nnodes is not None and nproc_per_node is None:
        raise click.UsageError("--nnodes needs --nproc-per-node (processes on each node)")
    if nproc_per_node is not None:
        return nnodes or 1, nproc_per_node
    return None


def _mismatch(degrees: str, need: int, dp_shard: int, world: int, given: str) -> CliError:
    others = need // dp_shard  # the product of every other degree
    hint = f" (e.g. --set mesh.data_parallel_shard={world // others})" if world % others == 0 else ""
    return CliError(
        f"{given} gives {world} processes, but the mesh ({degrees}) needs {need}; "
        f"change the mesh degrees so that their product is {world}{hint}, or launch {need} "
        f"process{'es' if need != 1 else ''}"
    )


@click.command(short_help="Validate a config for a launch size, without GPUs.")
@click.argument("config", type=click.Path())
@click.option("--world-size", type=click.IntRange(min=1), help="Processes in total (one node).")
@click.option("--nnodes", type=click.IntRange(min=1), help="Nodes (with --nproc-per-node).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), help="Processes per node.")
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Tokens per sample, for the activation estimate (default: dataset.seq_len of the config).",
)
@overrides_option
@reports_errors
def plan(
    config: str,
    world_size: int | None,
    nnodes: int | None,
    nproc_per_node: int | None,
    seq_len: int | None,
    overrides: Sequence[str],
) -> None:
    """Check CONFIG for a launch size without GPUs and print its plan.

    Loads and validates the config, builds the mesh in one process (a fake process group of any
    size), and prints: which global ranks share each mesh axis, the microbatches each data-parallel
    rank runs per step, the precision and activation checkpointing, a per-rank estimate of parameter
    + gradient + optimizer memory and of one microbatch's activations (from the model built on the
    meta device), and the torchrun command.
    Without a size, plans for the size the mesh needs.

    \b
    Examples:
      d9d plan config.yaml
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=8
      d9d plan config.yaml --nnodes 2 --nproc-per-node 8 --set mesh.data_parallel_shard=8 \\
          --set mesh.tensor_parallel=2
    """
    shape = _launch_shape(world_size, nnodes, nproc_per_node)
    check_config_path(config)
    from d9d.trainer import load_job_config

    loaded = load_job_config(config, list(overrides))
    job = loaded.config
    mesh = job.mesh
    need = mesh.world_size
    if shape is None:
        shape = (1, need)
    nodes, per_node = shape
    if nodes * per_node != need:
        given = (
            "--world-size" if world_size is not None else f"--nnodes {nodes} × --nproc-per-node {per_node}"
        )
        raise _mismatch(mesh.describe_degrees(), need, mesh.data_parallel_shard, nodes * per_node, given)

    from d9d.mesh import format_layout
    from d9d.trainer import resolve_job

    resolved = resolve_job(loaded)  # imports the providers and checks their config sections
    from d9d.trainer import TrainingError, check_model_mesh

    try:
        check_model_mesh(resolved)  # the model provider's own check of the degrees
    except TrainingError as exc:
        raise CliError(f"{config}: {exc}") from None
    lines = [
        f"config: {config}",
        format_layout(mesh),
        _data_line(job.providers.data, job.data, mesh.data_parallel),
    ]
    param_bytes, trainable_bytes, n_params = _model_size(resolved)
    states, what = _optimizer_states(job.providers.optimizer, job.optimizer)
    est = estimate_memory(
        param_bytes,
        trainable_bytes,
        pipeline_parallel=mesh.pipeline_parallel,
        data_parallel_shard=mesh.data_parallel_shard,
        tensor_parallel=mesh.tensor_parallel,
        optimizer_states=states,
    )
    split = f"pp {mesh.pipeline_parallel} × dp_shard {mesh.data_parallel_shard} × tp {mesh.tensor_parallel}"
    tcfg = job.trainer
    prec = tcfg.precision
    compute = "bfloat16" if prec.param_dtype == "auto" else prec.param_dtype
    auto = " (auto: bfloat16 on CUDA, float32 on CPU)" if prec.param_dtype == "auto" else ""
    ac = tcfg.activation_checkpointing
    ac_text = ac.mode + (f" (every {ac.every} blocks)" if ac.mode == "selective" else "")
    lines += [
        f"precision: compute {compute}{auto}, reduce {prec.reduce_dtype}, master weights and optimizer "
        f"float32; tf32 {'on' if prec.tf32 else 'off'}",
        f"activation checkpointing: {ac_text}; compile: {'on' if tcfg.compile.enabled else 'off'}",
        f"model: {n_params:,} parameters, {format_size(param_bytes)} "
        f"({format_size(trainable_bytes)} trainable)",
    ]
    acts, acts_note = _activations(resolved, seq_len, compute)
    total = est.total + (acts.checkpointed if acts is not None else 0)
    lines += [
        f"memory per rank (estimate; 1/{est.shard_factor} of the model: {split}):",
        f"  parameters  {format_size(est.params):>10}",
        f"  gradients   {format_size(est.grads):>10}",
        f"  optimizer   {format_size(est.optimizer):>10}  ({what})",
    ]
    if acts is not None:
        lines.append(
            f"  activations {format_size(acts.checkpointed):>10}  (one microbatch of {acts.tokens} tokens in "
            f"{compute}, checkpointing {ac.mode}; none: {format_size(acts.plain)}, full: {format_size(acts.full)})"
        )
    else:
        lines.append(f"  activations {'?':>10}  ({acts_note})")
    lines.append(f"  total       {format_size(total):>10}")
    where = "on every node: " if nodes > 1 else ""
    lines += [
        f"launch ({nodes} node{'s' if nodes > 1 else ''} × {per_node} process"
        f"{'es' if per_node > 1 else ''}):",
        f"  {where}{launch_command(config, overrides, nnodes=nodes, nproc_per_node=per_node)}",
    ]
    click.echo("\n".join(lines))


def _activations(
    job: "ResolvedJob", seq_len: int | None, compute: str
) -> tuple[ActivationEstimate | None, str]:
    """The activation estimate, or None and why there is none."""
    config = job.config
    if seq_len is None:
        value = config.dataset.get("seq_len") if isinstance(config.dataset, dict) else None
        seq_len = value if isinstance(value, int) and value > 0 else None
    if seq_len is None:
        return None, "not estimated: pass --seq-len (the config has no dataset.seq_len)"
    if config.providers.data != _AUTO_DATA:
        return None, "not estimated: the microbatch size is decided by a custom data provider"
    import msgspec

    from d9d.data import AutoDataConfig

    microbatch = msgspec.convert(config.data, AutoDataConfig).microbatch_size
    try:
        estimate = estimate_activations(
            job,
            seq_len=seq_len,
            microbatch_size=microbatch,
            param_dtype=compute,
            tensor_parallel=config.mesh.tensor_parallel * config.mesh.context_parallel,
        )
    except Exception as exc:  # a forward that cannot run on meta (e.g. MoE routing) is not an error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"not estimated: the forward does not run on the meta device ({first[:120]})"
    return estimate, ""


def _data_line(provider: str, data: dict[str, object], dp: int) -> str:
    if provider != _AUTO_DATA:
        return f"data: batching is decided by providers.data ({provider})"
    import msgspec

    from d9d.data import AutoDataConfig, microbatches_per_rank

    cfg = msgspec.convert(data, AutoDataConfig)  # validated when the job was resolved
    n = microbatches_per_rank(cfg.global_batch_size, cfg.microbatch_size, dp)
    return (
        f"data: global batch {cfg.global_batch_size} = {dp} data-parallel rank{'s' if dp > 1 else ''} × "
        f"{n} microbatch{'es' if n > 1 else ''} of {cfg.microbatch_size} per step"
    )


def _model_size(job: "ResolvedJob") -> tuple[int, int, int]:
    """(bytes, trainable bytes, parameter count) of the whole model, built on the meta device.

    The model provider sees rank 0 of the planned mesh (a fake process group) and builds the
    unsplit model (one pipeline stage), which is then only counted, never allocated.
    """
    import torch

    from d9d.mesh import DistributedContext
    from d9d.trainer import InitializeModelStageContext

    with DistributedContext.for_planning(job.config.mesh) as ctx, torch.device("meta"):
        model = job.model_provider.initialize_model_stage(InitializeModelStageContext(context=ctx)).model
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return total, trainable, sum(p.numel() for p in params)


def _optimizer_states(provider: str, optimizer: "OptimizerConfig") -> tuple[int, str]:
    """Optimizer tensors per trainable parameter, and how that number was decided."""
    if provider != _BUILTIN_OPTIMIZER:
        return 2, f"assumed AdamW-like, 2 states per parameter: {provider} is a custom optimizer"
    if optimizer.name == "adamw":
        return 2, "AdamW: exp_avg + exp_avg_sq"
    if optimizer.momentum:
        return 1, "SGD with momentum: 1 buffer"
    return 0, "SGD without momentum: no state"
