"""`d9d plan`: validate a job for a launch size without GPUs and print what it would run.

The memory figure is a deliberately simple estimate of the persistent training state per rank (no
temporary buffers, no allocator slack), see `estimate_memory`, plus the activations one microbatch
keeps for backward, counted from a forward on the meta device (`estimate_activations`) in the job's
compute dtype, with and without activation checkpointing. Under context parallelism that forward
runs one rank's share of the sequence with the planned cp group, as the trainer will. Under pipeline
parallelism it prints the trainer's layout (each pp rank's stages and their layers) and the
schedule's theoretical bubble, see `pipeline_bubble`.
"""

import itertools
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.commands._text import format_size
from d9d.cli.commands.init import d9d_invocation
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.mesh import MeshConfig
    from d9d.parallel import PipelineLayout, StageSpec
    from d9d.trainer import OptimizerConfig, PipeliningConfig, ResolvedJob

__all__ = [
    "ActivationEstimate",
    "MemoryEstimate",
    "PipelineBubble",
    "estimate_activations",
    "estimate_memory",
    "launch_command",
    "pipeline_bubble",
    "plan",
    "sequence_length_error",
]

#: Import path of the built-in data provider whose batching `plan` can report.
_AUTO_DATA = "d9d.trainer:AutoDataProviderFactory"
_BUILTIN_OPTIMIZER = "d9d.trainer:BuiltinOptimizerProvider"


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
class PipelineBubble:
    """A schedule's theoretical bubble: the share of a step's forward + backward time a pp rank idles.

    Attributes:
        fraction: idle time / step time (every rank alike); None where the formula does not apply.
        formula: the formula in p (pp ranks), v (stages per rank) and m (microbatches per step).
        source: the schedule family and where the formula comes from.
    """

    fraction: Fraction | None
    formula: str
    source: str


_ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv", "dualpipev")


def pipeline_bubble(schedule: str, pp_size: int, stages_per_rank: int, n_microbatches: int) -> PipelineBubble:
    """The bubble of `schedule` on `pp_size` ranks of `stages_per_rank` stages, for m microbatches per step.

    Every stage is assumed to take the same time per microbatch (a rank's v stages each 1/v of its
    share) and communication to be free. GPipe and 1F1B fill and drain the pipeline once per pass:
    (p−1)/(m+p−1). Interleaved 1F1B and looped BFS run v stages of 1/v the time per rank, which cuts
    the fill and drain to (p−1)/v stage times: (p−1)/(v·m+p−1); with m < p the microbatches do not
    cover a round over the ranks and each of the v−1 later rounds idles another p−m stage times.
    Zero-bubble schedules split the backward into input- and weight-gradient parts and run the weight
    part where the others would leave the pipeline's fill and drain idle: ≈ 0 when forward, input
    and weight gradient take equal time and m ≥ p·v (fewer microbatches than stages leave the
    warm-up uncovered: no figure).
    """
    p, v, m = pp_size, stages_per_rank, n_microbatches
    if schedule in _ZERO_BUBBLE:
        source = {
            "interleaved_zero_bubble": "interleaved zero bubble (Qi et al., Zero Bubble Pipeline Parallelism, 2024)",
            "zbv": "ZB-V (Qi et al., Zero Bubble Pipeline Parallelism, 2024)",
            "dualpipev": "DualPipeV (DeepSeek-V3's DualPipe cut to a V, Sea AI Lab 2025)",
        }[schedule]
        if m >= p * v:
            return PipelineBubble(Fraction(0), "≈ 0 for m ≥ p·v", source)
        return PipelineBubble(None, "≈ 0 only for m ≥ p·v", source)
    if schedule in ("gpipe", "1f1b"):
        source = {
            "gpipe": "GPipe (Huang et al. 2019)",
            "1f1b": "1F1B (PipeDream-Flush; Narayanan et al. 2021)",
        }[schedule]
        return PipelineBubble(Fraction(p - 1, m + p - 1), "(p−1)/(m+p−1)", source)
    source = {
        "interleaved_1f1b": "interleaved 1F1B (Narayanan et al., Megatron-LM, 2021)",
        "looped_bfs": "looped BFS (Lamy-Poirier, Breadth-First Pipeline Parallelism, 2023)",
    }[schedule]
    if m >= p:
        return PipelineBubble(Fraction(p - 1, v * m + p - 1), "(p−1)/(v·m+p−1)", source)
    idle = (p - 1) + (v - 1) * (p - m)
    return PipelineBubble(
        Fraction(idle, v * m + idle), "((p−1)+(v−1)(p−m))/(v·m+(p−1)+(v−1)(p−m)) for m < p", source
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


def estimate_activations(
    job: "ResolvedJob", *, seq_len: int, microbatch_size: int, param_dtype: str
) -> ActivationEstimate:
    """Run the task's loss on the meta device (no memory) and count what autograd saves for backward.

    The model is cast to `param_dtype` (as FSDP2 computes); blocks are the entries of the model's
    largest ModuleList/ModuleDict. `seq_len` is the dataset's full sequence length. Under context
    parallelism the model gets the planned mesh's cp group (`parallelize_context_parallel`, on a
    fake process group) and the forward runs rank 0's share of each sequence (seq_len / cp tokens),
    so everything is counted at that length except the K/V that attention all-gathers, which it
    keeps at the full length for backward. `F.scaled_dot_product_attention` is counted as the fused
    kernels on CUDA and CPU save it (q, k, v, output, float32 log-sum-exp), not as its math path,
    which the meta device would take (a float32 seq × seq matrix). Tensor parallelism divides
    activations by tp (sequence-parallel norms, split heads); a pipeline stage holds 1/pp of the
    layers but, with 1F1B, up to pp microbatches in flight, so pp leaves the figure as it is.

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
        parallelize_context_parallel,
        saved_activation_bytes,
    )
    from d9d.trainer import InitializeModelStageContext, LossContext

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[param_dtype]
    config = job.config.trainer.activation_checkpointing
    mesh = job.config.mesh
    with DistributedContext.for_planning(mesh) as ctx:  # the cp group's collectives run on meta tensors
        with torch.device("meta"):
            base = job.model_provider.initialize_model_stage(InitializeModelStageContext(context=ctx)).model
        base = base.to(dtype)
        shape = (microbatch_size, seq_len)  # ids and labels are two tensors, as a dataset gives them
        batch: Any = {
            name: torch.zeros(shape, dtype=torch.long, device="meta") for name in ("input_ids", "labels")
        }
        if mesh.context_parallel > 1:
            batch = parallelize_context_parallel(base, ctx.mesh("dense")).shard_batch(batch)

        def measure(mode: str) -> int:
            model = copy.deepcopy(base)  # the cp group is shared, not copied
            if mode != "none":
                blocks = _blocks(model)
                apply_activation_checkpointing(
                    blocks, ActivationCheckpointingConfig(mode=mode, every=config.every)
                )  # type: ignore[arg-type]

            def loss() -> object:
                return job.task.compute_loss(
                    LossContext(model=model, batch=batch, device=torch.device("meta"))
                )

            with _attention_as_fused_kernel():
                saved = saved_activation_bytes(loss, exclude=model.parameters())
            return -(-saved // mesh.tensor_parallel)

        plain = measure("none")
        full = measure("full")
        checkpointed = {"none": plain, "full": full}.get(config.mode) or measure(config.mode)
    local = seq_len // mesh.context_parallel
    return ActivationEstimate(
        plain=plain, checkpointed=checkpointed, full=full, tokens=f"{microbatch_size} × {local}"
    )


def _attention_as_fused_kernel() -> Any:
    """A torch function mode under which `F.scaled_dot_product_attention` (shapes only, for meta tensors)
    saves for backward what the fused kernels of CUDA and CPU save: q, k, v, output, log-sum-exp."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class FusedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            log_sum_exp = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, log_sum_exp)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> Any:
            raise NotImplementedError("only counts what a forward saves")

    class AttentionAsFusedKernel(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                named = {**dict(zip(("query", "key", "value"), args, strict=False)), **kwargs}
                return FusedAttention.apply(named["query"], named["key"], named["value"])
            return func(*args, **kwargs)

    return AttentionAsFusedKernel()


def _blocks(model: "object") -> list["object"]:
    """The transformer blocks: the entries of the largest ModuleList/ModuleDict (by parameters)."""
    from torch import nn

    containers = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]  # type: ignore[attr-defined]
    if not containers:
        return []
    best = max(containers, key=lambda c: sum(p.numel() for p in c.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)


def launch_command(
    config: str, overrides: Sequence[str], *, nnodes: int, nproc_per_node: int, d9d: str = "d9d"
) -> str:
    """The shell command that launches `d9d train` for this many nodes and processes per node.

    One process in all runs `d9d train` itself; several go through torchrun (several nodes rendezvous at
    node 0: fill in its host). `d9d` is how the shell runs d9d (`d9d_invocation()`: the bare name
    or this environment's script, e.g. under `uv run`); torchrun is then taken from the same place.
    """
    args = [config]
    for item in overrides:
        args += ["--set", item]
    job = " ".join(shlex.quote(part) for part in args)
    if nnodes * nproc_per_node == 1:
        return f"{d9d} train {job}"
    torchrun = _torchrun_beside(d9d)
    if nnodes == 1:
        return f"{torchrun} --nproc-per-node {nproc_per_node} -m d9d.cli train {job}"
    return (
        f"{torchrun} --nnodes {nnodes} --nproc-per-node {nproc_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint HOST_OF_NODE_0:29500 -m d9d.cli train {job}"
    )


def _torchrun_beside(d9d: str) -> str:
    """torchrun of the environment that `d9d` (a `d9d_invocation()` answer) runs from.

    torchrun runs `-m d9d.cli` with its own interpreter, so it must be this environment's: its
    `torchrun` script next to the `d9d` script (torch installs both), or `PYTHON -m
    torch.distributed.run` when d9d runs as `PYTHON -m d9d.cli`.
    """
    if d9d == "d9d":  # this environment's bin directory is on the shell's PATH
        return "torchrun"
    parts = shlex.split(d9d)
    if parts[1:] == ["-m", "d9d.cli"]:
        return f"{shlex.quote(parts[0])} -m torch.distributed.run"
    return shlex.quote(str(Path(parts[0]).with_stem("torchrun")))


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
    help="Tokens per sample, for the activation estimate and the context-parallel split (default: the "
    "dataset's seq_len: dataset.seq_len, or its provider's default).",
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
    rank runs per step, under context parallelism the cp groups and each rank's share of a
    sequence, under pipeline parallelism each pp rank's stages (their layers, the embedding, the
    head) and the schedule's theoretical bubble, the precision and activation checkpointing, a
    per-rank estimate of parameter + gradient + optimizer memory and of one microbatch's activations
    (from the model built on the meta device), and the launch command.
    Without a size, plans for the size the mesh needs.

    \b
    Examples:
      d9d plan config.yaml
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=8
      d9d plan config.yaml --nnodes 2 --nproc-per-node 8 --set mesh.data_parallel_shard=8 \\
          --set mesh.tensor_parallel=2
      d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=2 \\
          --set mesh.context_parallel=2 --set mesh.tensor_parallel=2
      d9d plan config.yaml --world-size 2 --set mesh.pipeline_parallel=2 \\
          --set pipelining.schedule=zbv
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
    layout, n_microbatches = None, None
    if mesh.pipeline_parallel > 1:  # the trainer plans the stages before it checks sequence lengths
        n_microbatches = _microbatches_per_step(job.providers.data, job.data, mesh.data_parallel)
        layout = _pipeline_layout(resolved, n_microbatches)
    cp = mesh.context_parallel
    dataset_seq, source = _dataset_seq_len(resolved)
    for length, option in ((dataset_seq, None), (seq_len, "--seq-len")):
        if length is not None and (problem := sequence_length_error(length, cp, option=option)):
            raise CliError(problem)  # the dataset's: as the trainer refuses it, before data or model
    seq = (seq_len, "--seq-len") if seq_len is not None else (dataset_seq, source)
    lines = [
        f"config: {config}",
        format_layout(mesh),
        _data_line(job.providers.data, job.data, mesh.data_parallel),
    ]
    if cp > 1:
        lines += _context_parallel_lines(mesh, *seq)
    if layout is not None:
        lines += _pipeline_lines(mesh, layout, n_microbatches, job.pipelining)
    param_bytes, trainable_bytes, n_params = _model_size(resolved, config)
    states, what = _optimizer_states(job.providers.optimizer, job.optimizer)
    est = estimate_memory(
        param_bytes,
        trainable_bytes,
        pipeline_parallel=mesh.pipeline_parallel,
        data_parallel_shard=mesh.data_parallel_shard,
        context_parallel=cp,
        tensor_parallel=mesh.tensor_parallel,
        optimizer_states=states,
    )
    split = (
        f"pp {mesh.pipeline_parallel} × dp_shard {mesh.data_parallel_shard} × cp {cp} × "
        f"tp {mesh.tensor_parallel}"
    )
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
    acts, acts_note = _activations(resolved, *seq, compute)
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
    if acts is not None:
        lines.append(
            f"  activation estimate assumes: {_activation_assumptions(mesh, job.pipelining.schedule)}"
        )
    where = "on every node: " if nodes > 1 else ""
    command = launch_command(config, overrides, nnodes=nodes, nproc_per_node=per_node, d9d=d9d_invocation())
    lines += [
        f"launch ({nodes} node{'s' if nodes > 1 else ''} × {per_node} process"
        f"{'es' if per_node > 1 else ''}):",
        f"  {where}{command}",
    ]
    click.echo("\n".join(lines))


def sequence_length_error(seq_len: int, context_parallel: int, *, option: str | None = None) -> str | None:
    """Why context parallelism cannot split sequences of `seq_len` tokens, or None when it can.

    For the dataset's length it is the trainer's message, word for word; `option` names the
    command-line option the length came from instead (`--seq-len`).
    """
    from d9d.trainer import sequence_length_problem

    chunks = 2 * context_parallel
    if context_parallel <= 1 or seq_len % chunks == 0:
        return None
    if option is None:
        return sequence_length_problem(seq_len, context_parallel)
    return (
        f"{option} {seq_len} is not divisible by 2 × mesh.context_parallel = {chunks} (context "
        f"parallelism cuts each sequence into {chunks} equal chunks); pass a multiple of {chunks} or "
        "change mesh.context_parallel"
    )


def _dataset_seq_len(job: "ResolvedJob") -> tuple[int | None, str]:
    """The dataset's sequence length as far as the config tells it without loading data, and from where.

    `dataset.seq_len` when the config sets it, else the `seq_len` default of the dataset provider's
    `config_type`; (None, why) when neither exists.
    """
    section = job.config.dataset
    value = section.get("seq_len") if isinstance(section, dict) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value, "dataset.seq_len"
    config_type = getattr(job.dataset_provider, "config_type", None)
    if job.dataset_provider is not None and config_type is not None:
        import msgspec

        try:
            value = getattr(msgspec.convert(section, config_type), "seq_len", None)
        except (ValueError, TypeError):  # resolve_job converted it already: not expected
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            return value, f"the seq_len default of providers.dataset ({job.config.providers.dataset})"
    return None, "neither dataset.seq_len nor the dataset provider's config_type gives it"


def _context_parallel_lines(mesh: "MeshConfig", seq_len: int | None, source: str) -> list[str]:
    """The cp groups (in cp-rank order) and each rank's share of a sequence, for a mesh with cp > 1."""
    from d9d.mesh import axis_groups

    cp = mesh.context_parallel
    chunks = 2 * cp
    groups = axis_groups(mesh, "batch", "cp")
    shown = ", ".join(_format_group(g) for g in groups[:4])
    more = f", … ({len(groups)} groups)" if len(groups) > 4 else ""
    layout = f"chunks r and {chunks - 1}−r of {chunks} for cp rank r"
    if seq_len is None:
        share = (
            f"seq_len / {cp} tokens ({layout}); the sequence length is not known without loading data "
            f"({source}): pass --seq-len to check it"
        )
    else:
        share = (
            f"{seq_len} / {cp} = {seq_len // cp} tokens ({layout}, {seq_len // chunks} tokens each; "
            f"{seq_len} from {source})"
        )
    return [
        f"context parallel: cp {cp}; the ranks of a cp group get the same samples and split every sequence",
        f"  cp groups (in cp-rank order): {shown}{more}",
        f"  sequence per rank: {share}",
    ]


def _format_group(group: list[int]) -> str:
    """Ranks as the mesh table writes them: `[0,2]`, `[0..3]`, `[0..12 step 4]`."""
    step = group[1] - group[0] if len(group) > 2 else 0
    if step and all(b - a == step for a, b in itertools.pairwise(group)):
        return f"[{group[0]}..{group[-1]}" + (f" step {step}]" if step != 1 else "]")
    return "[" + ",".join(map(str, group)) + "]"


def _pipeline_layout(job: "ResolvedJob", n_microbatches: int | None) -> "PipelineLayout":
    """The layout the trainer will run (`d9d.trainer.step.plan_pipeline_stage`'s checks, with its
    messages, and its `plan_pipeline` call), without building the data provider.

    `n_microbatches` None (a custom data provider decides them) skips the schedule's microbatch check,
    which the trainer makes at start.

    Raises:
        TrainingError: the model provider or the task cannot run a pipeline.
        PipelineError: the schedule, stage, layer or microbatch counts do not fit.
    """
    from d9d.trainer import pipeline_layout

    return pipeline_layout(job, job.config.mesh.pipeline_parallel, n_microbatches)


def _pipeline_lines(
    mesh: "MeshConfig", layout: "PipelineLayout", n_microbatches: int | None, pipelining: "PipeliningConfig"
) -> list[str]:
    """The schedule, each pp rank's stages (global ranks, layers, embedding and head) and the bubble."""
    from d9d.mesh import axis_groups

    p, v, n = layout.pp_size, layout.stages_per_rank, layout.num_stages
    num_layers = sum(len(s.layers) for s in layout.stages)
    if v == 1:
        shape = f"{n} stages, one per pp rank"
    elif layout.config.info.style == "v":
        shape = f"{p} × {v} = {n} stages, V-shaped (stages r and {n - 1}−r on pp rank r)"
    else:
        shape = f"{p} × {v} = {n} stages, looped (stage s on pp rank s mod {p})"
    lines = [
        f"pipeline parallel: pp {p}, schedule {layout.config.schedule}, {shape}; {num_layers} layers split "
        f"with the embedding and the head counted as {pipelining.embedding_weight:g} and "
        f"{pipelining.head_weight:g} layers (pipelining.embedding_weight, head_weight)"
    ]
    groups = axis_groups(mesh, "dense", "pp")
    for rank in range(p):
        ranks = _format_ranks(sorted(g[rank] for g in groups))
        chunks = "; ".join(f"stage {s.index}: {_stage_content(s)}" for s in layout.stages_of_rank(rank))
        lines.append(f"  pp rank {rank} (ranks {ranks}): {chunks}")
    lines += _bubble_lines(layout, n_microbatches)
    return lines


def _stage_content(stage: "StageSpec") -> str:
    """What a stage holds: `embedding + layers 0..3 + head`, `layer 4`."""
    parts = ["embedding"] if stage.is_first else []
    layers = stage.layers
    if len(layers) == 1:
        parts.append(f"layer {layers.start}")
    elif len(layers) > 1:
        parts.append(f"layers {layers.start}..{layers.stop - 1}")
    if stage.is_last:
        parts.append("head")
    return " + ".join(parts) or "no layers"


def _format_ranks(ranks: list[int]) -> str:
    """Global ranks as the mesh table writes them (`[0..3]`), at most 8 listed one by one."""
    if len(ranks) <= 8 or len({b - a for a, b in itertools.pairwise(ranks)}) == 1:
        return _format_group(ranks)
    return "[" + ",".join(map(str, ranks[:4])) + f",…] ({len(ranks)} ranks)"


def _bubble_lines(layout: "PipelineLayout", n_microbatches: int | None) -> list[str]:
    """The schedule's theoretical bubble for this layout, the formula and what it assumes."""
    p, v, n = layout.pp_size, layout.stages_per_rank, layout.num_stages
    schedule = layout.config.schedule
    assumes = (
        "every stage takes the same time per microbatch; communication is free; theory, not a measurement"
    )
    if schedule in _ZERO_BUBBLE:
        assumes += "; the backward's input- and weight-gradient parts take as long as the forward"
    if n_microbatches is None:
        probe = pipeline_bubble(schedule, p, v, max(p, n))  # the formula for enough microbatches
        return [
            f"  bubble: {probe.formula} with p={p}, v={v} and m the microbatches per step, which "
            f"providers.data decides ({probe.source}); the trainer checks m against the schedule at start",
            f"  bubble assumes: {assumes}",
        ]
    m = n_microbatches
    bubble = pipeline_bubble(schedule, p, v, m)
    symbols = f"p={p}, v={v}, m={m}"
    if bubble.fraction is None:
        head = (
            f"not ≈ 0: m={m} microbatches < {n} stages leave the warm-up and cool-down uncovered "
            f"({bubble.formula}; {bubble.source}); give each pipeline at least {n} microbatches per step"
        )
    elif bubble.fraction == 0:
        head = f"≈ 0 of the step (m={m} ≥ p·v = {n} stages; {bubble.source})"
    else:
        f = bubble.fraction
        head = (
            f"{f.numerator}/{f.denominator} = {float(f):.1%} of the step's forward and backward time "
            f"({bubble.formula} with {symbols}; {bubble.source})"
        )
    return [f"  bubble: {head}", f"  bubble assumes: {assumes}"]


def _activation_assumptions(mesh: "MeshConfig", schedule: str) -> str:
    """What the activation figure assumes, in one line (see `estimate_activations`)."""
    parts = ["attention saves what a fused (flash) kernel saves"]
    if mesh.context_parallel > 1:
        parts.append(
            f"each rank holds 1/{mesh.context_parallel} of the sequence, except the K/V that attention "
            "all-gathers (full length)"
        )
    if mesh.tensor_parallel > 1:
        parts.append(f"divided by tp {mesh.tensor_parallel}")
    if mesh.pipeline_parallel > 1:
        other = "" if schedule == "1f1b" else f"; the {schedule} schedule keeps another number in flight"
        parts.append(
            f"all the layers with up to pp {mesh.pipeline_parallel} microbatches in flight (1F1B{other})"
        )
    return "; ".join(parts)


def _activations(
    job: "ResolvedJob", seq_len: int | None, source: str, compute: str
) -> tuple[ActivationEstimate | None, str]:
    """The activation estimate, or None and why there is none (`source`: why seq_len is None)."""
    config = job.config
    if seq_len is None:
        return None, f"not estimated: pass --seq-len (the sequence length: {source})"
    if config.providers.data != _AUTO_DATA:
        return None, "not estimated: the microbatch size is decided by a custom data provider"
    import msgspec

    from d9d.data import AutoDataConfig

    microbatch = msgspec.convert(config.data, AutoDataConfig).microbatch_size
    try:
        estimate = estimate_activations(job, seq_len=seq_len, microbatch_size=microbatch, param_dtype=compute)
    except Exception as exc:  # a forward that cannot run on meta (e.g. MoE routing) is not an error
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"not estimated: the forward does not run on the meta device ({first[:120]})"
    return estimate, ""


def _microbatches_per_step(provider: str, data: dict[str, object], dp: int) -> int | None:
    """Microbatches each data-parallel rank runs per step (as the built-in data provider will count
    them), or None under a custom data provider, which decides them itself.

    Raises:
        BatchSizeError: the global batch does not split into dp × microbatches.
    """
    if provider != _AUTO_DATA:
        return None
    import msgspec

    from d9d.data import AutoDataConfig, microbatches_per_rank

    cfg = msgspec.convert(data, AutoDataConfig)  # validated when the job was resolved
    return microbatches_per_rank(cfg.global_batch_size, cfg.microbatch_size, dp)


def _data_line(provider: str, data: dict[str, object], dp: int) -> str:
    n = _microbatches_per_step(provider, data, dp)
    if n is None:
        return f"data: batching is decided by providers.data ({provider})"
    import msgspec

    from d9d.data import AutoDataConfig

    cfg = msgspec.convert(data, AutoDataConfig)
    return (
        f"data: global batch {cfg.global_batch_size} = {dp} data-parallel rank{'s' if dp > 1 else ''} × "
        f"{n} microbatch{'es' if n > 1 else ''} of {cfg.microbatch_size} per step"
    )


def _model_size(job: "ResolvedJob", where: str) -> tuple[int, int, int]:
    """(bytes, trainable bytes, parameter count) of the whole model, built on the meta device.

    The model provider sees rank 0 of the planned mesh (a fake process group) and builds the
    unsplit model (one pipeline stage), which is then only counted, never allocated.

    Raises:
        CliError: mesh.context_parallel > 1 but no module of the model supports it (the trainer
            refuses such a job once the model is built).
    """
    import torch

    from d9d.mesh import DistributedContext
    from d9d.parallel import ParallelizeError, parallelize_context_parallel
    from d9d.trainer import InitializeModelStageContext

    with DistributedContext.for_planning(job.config.mesh) as ctx:
        with torch.device("meta"):
            model = job.model_provider.initialize_model_stage(InitializeModelStageContext(context=ctx)).model
        if job.config.mesh.context_parallel > 1:
            try:
                parallelize_context_parallel(model, ctx.mesh("dense"))
            except ParallelizeError as exc:
                raise CliError(f"{where}: {exc}") from None
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
