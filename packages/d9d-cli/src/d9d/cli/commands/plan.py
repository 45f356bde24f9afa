"""`d9d plan`: validate a job for a launch size without GPUs and print what it would run.

The memory figure is a deliberately simple estimate of the persistent training state per rank (no
activations, no temporary buffers, no allocator slack), see `estimate_memory`.
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

__all__ = ["MemoryEstimate", "estimate_memory", "launch_command", "plan"]

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
@overrides_option
@reports_errors
def plan(
    config: str,
    world_size: int | None,
    nnodes: int | None,
    nproc_per_node: int | None,
    overrides: Sequence[str],
) -> None:
    """Check CONFIG for a launch size without GPUs and print its plan.

    Loads and validates the config, builds the mesh in one process (a fake process group of any
    size), and prints: which global ranks share each mesh axis, the microbatches each data-parallel
    rank runs per step, a per-rank estimate of parameter + gradient + optimizer memory (from the
    model built on the meta device; activations not included), and the torchrun command.
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
    lines += [
        f"model: {n_params:,} parameters, {format_size(param_bytes)} "
        f"({format_size(trainable_bytes)} trainable)",
        f"memory per rank (estimate; 1/{est.shard_factor} of the model: {split}; no activations):",
        f"  parameters  {format_size(est.params):>10}",
        f"  gradients   {format_size(est.grads):>10}",
        f"  optimizer   {format_size(est.optimizer):>10}  ({what})",
        f"  total       {format_size(est.total):>10}",
    ]
    where = "on every node: " if nodes > 1 else ""
    lines += [
        f"launch ({nodes} node{'s' if nodes > 1 else ''} × {per_node} process"
        f"{'es' if per_node > 1 else ''}):",
        f"  {where}{launch_command(config, overrides, nnodes=nodes, nproc_per_node=per_node)}",
    ]
    click.echo("\n".join(lines))


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
