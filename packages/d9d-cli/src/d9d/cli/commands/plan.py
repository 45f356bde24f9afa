"""`d9d plan`: validate a job for a launch size without GPUs and print what it would run.

The plan is the trainer's own (`d9d.trainer.planning.plan_job` on a planning context of the launch's size, for
CUDA): this command only formats it, so it accepts and refuses what the trainer does, with its words.
It prints the mesh layout, the batching, under context parallelism each rank's share of a sequence,
under pipeline parallelism each pp rank's stages and the schedule's theoretical bubble, the precision
and a per-rank memory estimate (`plan_job(..., memory=True)`), whether that fits a device's memory
and, when it does not, which `--set` changes would make it fit (`d9d.trainer.planning.plan_fit`), and the
launch command.
"""

import itertools
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from d9d.cli.commands._options import check_config_path, overrides_option
from d9d.cli.commands._text import format_size, parse_size
from d9d.cli.commands.init import d9d_invocation
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.mesh import MeshConfig
    from d9d.parallel.pipeline import StageSpec
    from d9d.trainer import JobConfig, LoadedJob
    from d9d.trainer.config import PipeliningConfig
    from d9d.trainer.planning import FitPlan, JobPlan, PipelinePlan, SequencePlan

__all__ = ["launch_command", "plan", "slurm_script"]


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


def slurm_script(
    config: str, overrides: Sequence[str], *, nnodes: int, nproc_per_node: int, name: str, d9d: str = "d9d"
) -> list[str]:
    """An sbatch script (its lines) that runs the job on `nnodes` Slurm nodes: one task per node, each
    a torchrun agent of `nproc_per_node` processes meeting at a c10d rendezvous on the job's first
    node (port 29500), whose id is the Slurm job id."""
    args = [config]
    for item in overrides:
        args += ["--set", item]
    job = " ".join(shlex.quote(part) for part in args)
    torchrun = _torchrun_beside(d9d)
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(name)}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc_per_node}",
        f"#SBATCH --output={shlex.quote(name)}-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun {torchrun} --nnodes "$SLURM_NNODES" --nproc-per-node {nproc_per_node} --rdzv-backend c10d '
        f'--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID" -m d9d.cli train {job}',
    ]


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
@click.option(
    "--device-memory",
    metavar="SIZE",
    help="Memory of one device (e.g. 80GiB, 24GB, 512MiB, or bytes): says whether the job fits and, "
    "when it does not, which --set changes would make it fit (default: the local GPU's, when there is one).",
)
@click.option(
    "--launcher",
    type=click.Choice(["torchrun", "slurm"]),
    default="torchrun",
    show_default=True,
    help="torchrun: end with the command for every node; slurm: print an sbatch script instead, "
    "the plan in its comments (d9d plan ... --launcher slurm > job.sbatch; sbatch job.sbatch).",
)
@overrides_option
@reports_errors
def plan(
    config: str,
    world_size: int | None,
    nnodes: int | None,
    nproc_per_node: int | None,
    seq_len: int | None,
    device_memory: str | None,
    launcher: str,
    overrides: Sequence[str],
) -> None:
    """Check CONFIG for a launch size without GPUs and print its plan.

    Loads and validates the config, builds the mesh in one process (a fake process group of any
    size), and prints: which global ranks share each mesh axis, the microbatches each data-parallel
    rank runs per step, under context parallelism the cp groups and each rank's share of a
    sequence, under pipeline parallelism each pp rank's stages (their layers, the embedding, the
    head) and the schedule's theoretical bubble, the precision and activation checkpointing, a
    per-rank estimate of parameter + gradient + optimizer memory and of one microbatch's activations
    (from the model built on the meta device), whether that fits in --device-memory (or the local
    GPU) with 10% to spare and, when it does not, the --set changes that would make it fit, each
    re-planned, and the launch command.
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
      d9d plan config.yaml --device-memory 80GiB
      d9d plan config.yaml --nnodes 4 --nproc-per-node 8 --set mesh.data_parallel_shard=auto \\
          --launcher slurm > job.sbatch
    """
    shape = _launch_shape(world_size, nnodes, nproc_per_node)
    device_bytes = _device_memory_option(device_memory)
    check_config_path(config)
    from d9d.trainer import load_job_config

    # a mesh degree of `auto` takes what the launch shape leaves it
    launched = shape[0] * shape[1] if shape is not None else None
    loaded = load_job_config(config, list(overrides), world_size=launched)
    mesh = loaded.config.mesh
    need = mesh.world_size
    nodes, per_node = shape if shape is not None else (1, need)
    if nodes * per_node != need:
        given = (
            "--world-size" if world_size is not None else f"--nnodes {nodes} × --nproc-per-node {per_node}"
        )
        raise _mismatch(mesh.describe_degrees(), need, mesh.data_parallel_shard, nodes * per_node, given)
    from d9d.trainer.planning import plan_config

    job_plan = plan_config(loaded, seq_len=seq_len, device="cuda")  # rank 0 of the launch, for CUDA
    fit_lines = _fit_lines(job_plan, loaded, device_bytes)
    command = launch_command(config, overrides, nnodes=nodes, nproc_per_node=per_node, d9d=d9d_invocation())
    where = "on every node: " if nodes > 1 else ""
    lines = [f"config: {config}", *_plan_lines(job_plan, loaded.config), *fit_lines]
    if launcher == "slurm":
        script = slurm_script(config, overrides, nnodes=nodes, nproc_per_node=per_node,
                              name=loaded.config.trainer.run.name, d9d=d9d_invocation())  # fmt: skip
        click.echo(
            "\n".join(
                [
                    script[0],
                    *script[1:6],
                    *(f"# {part}" for line in lines for part in line.splitlines()),
                    *script[6:],
                ]
            )
        )
        return
    lines += [
        f"launch ({nodes} node{'s' if nodes > 1 else ''} × {per_node} process{'es' if per_node > 1 else ''}):",
        f"  {where}{command}",
    ]
    click.echo("\n".join(lines))


def _device_memory_option(text: str | None) -> int | None:
    """--device-memory in bytes (None when not given), checked before anything is loaded."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise CliError(f"--device-memory {exc}") from None


def _fit_lines(job_plan: "JobPlan", loaded: "LoadedJob", device_bytes: int | None) -> list[str]:
    """Whether the plan fits the device (--device-memory, else the local GPU) and, when not, the levers."""
    source = "--device-memory"
    if device_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return [
                "fit: pass --device-memory SIZE (e.g. 80GiB) to check that the job fits a device and "
                "which --set changes would make it fit"
            ]
        index = torch.cuda.current_device()
        device_bytes = torch.cuda.get_device_properties(index).total_memory
        source = f"the local GPU, {torch.cuda.get_device_name(index)}"
    from d9d.trainer.planning import plan_fit

    return _format_fit(plan_fit(job_plan, loaded, device_bytes), source)


def _format_fit(fit: "FitPlan", source: str) -> list[str]:
    from d9d.trainer.planning import FIT_HEADROOM

    budget = f"{format_size(fit.budget)} ({FIT_HEADROOM:.0%} of {format_size(fit.device_bytes)}, {source})"
    note = f"; {fit.activations_note}" if fit.activations_note else ""
    if fit.fits:
        return [
            f"fits: {format_size(fit.total)} per rank of {budget}, {format_size(fit.margin)} to spare{note}"
        ]
    lines = [
        f"does not fit: {format_size(fit.total)} per rank, {format_size(-fit.margin)} over {budget}{note}"
    ]
    if not fit.levers:
        return [*lines, "  no lever applies: use a shorter sequence, a smaller model or a larger device"]
    lines.append("  levers (each re-planned; the most a rank needs with it):")
    for lever in fit.levers:
        status = "fits" if lever.fits else "too big"
        lines += [f"  {status:<7} {format_size(lever.total):>10}  {lever.arguments}", f"      {lever.reason}"]
    if not any(lever.fits for lever in fit.levers):
        lines.append("  none of these fits: use a shorter sequence, a smaller model or a larger device")
    return lines


def _plan_lines(job_plan: "JobPlan", config: "JobConfig") -> list[str]:
    """Every section of the plan: layout, data, cp, pipeline, precision, model and memory."""
    from d9d.mesh import format_layout

    mesh = job_plan.mesh
    lines = [format_layout(mesh), _data_line(job_plan, config.providers.data)]
    if mesh.context_parallel > 1:
        lines += _context_parallel_lines(job_plan.sequence, mesh.context_parallel)
    if job_plan.pipeline is not None:
        lines += _pipeline_lines(job_plan.pipeline, config.pipelining)
    return lines + _precision_lines(job_plan, config) + _memory_lines(job_plan, config)


def _data_line(job_plan: "JobPlan", provider: str) -> str:
    b = job_plan.batching
    if b is None:
        return f"data: batching is decided by providers.data ({provider})"
    n, dp = b.microbatches_per_step, b.data_parallel
    return (
        f"data: global batch {b.global_batch_size} = {dp} data-parallel rank{'s' if dp > 1 else ''} × "
        f"{n} microbatch{'es' if n > 1 else ''} of {b.microbatch_size} per step"
    )


def _precision_lines(job_plan: "JobPlan", config: "JobConfig") -> list[str]:
    tcfg = config.trainer
    prec = tcfg.precision
    compute = str(job_plan.precision.param_dtype).removeprefix("torch.")
    auto = " (auto: bfloat16 on CUDA, float32 on CPU)" if prec.param_dtype == "auto" else ""
    ac = tcfg.activation_checkpointing
    ac_text = ac.mode + (f" (every {ac.every} blocks)" if ac.mode == "selective" else "")
    lines = [
        f"precision: compute {compute}{auto}, reduce {prec.reduce_dtype}, master weights float32, "
        f"optimizer states {_state_dtype(job_plan)}; tf32 {'on' if prec.tf32 else 'off'}",
        f"activation checkpointing: {ac_text}; compile: {'on' if tcfg.compile.enabled else 'off'}",
    ]
    memory = job_plan.memory
    if memory is not None and memory.float8 is not None:
        gathered = "; FSDP all-gathers their weights in float8" if memory.float8_all_gather else ""
        lines.append(f"float8: {memory.float8.describe()}{gathered}")
    return lines


def _state_dtype(job_plan: "JobPlan") -> str:
    """The optimizer states' dtype: the declared one, else the float32 master weights'."""
    dtype = job_plan.optimizer_states.dtype
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def _states_text(job_plan: "JobPlan") -> str:
    """What the optimizer keeps, e.g. "AdamW: exp_avg + exp_avg_sq, in bfloat16"."""
    states = job_plan.optimizer_states
    if not states.per_parameter:
        return states.description
    return f"{states.description}, in {_state_dtype(job_plan)}"


def _memory_lines(job_plan: "JobPlan", config: "JobConfig") -> list[str]:
    memory = job_plan.memory
    assert memory is not None
    mesh, est, acts = job_plan.mesh, memory.state, memory.activations
    compute = str(job_plan.precision.param_dtype).removeprefix("torch.")
    split = (
        f"pp {mesh.pipeline_parallel} × dp_shard {mesh.data_parallel_shard} × cp {mesh.context_parallel} × "
        f"tp {mesh.tensor_parallel}"
    )
    ac = config.trainer.activation_checkpointing
    lines = [
        f"model: {memory.parameters:,} parameters, {format_size(memory.param_bytes)} "
        f"({format_size(memory.trainable_bytes)} trainable)",
        f"memory per rank (estimate; 1/{est.shard_factor} of the model: {split}):",
        f"  parameters  {format_size(est.params):>10}",
        f"  gradients   {format_size(est.grads):>10}",
        f"  optimizer   {format_size(est.optimizer):>10}  ({_states_text(job_plan)})",
    ]
    if acts is not None:
        flight = ""
        if any(n > 1 for n in acts.in_flight):
            flight = f" × {'+'.join(str(n) for n in acts.in_flight)} in flight"
        dtype = compute
        if config.trainer.precision.param_dtype == "auto":
            dtype = f"{compute}, the auto dtype on CUDA (a CPU run computes in float32: about 2×)"
        lines.append(
            f"  activations {format_size(acts.checkpointed):>10}  (one microbatch of {acts.tokens} tokens"
            f"{flight} in {dtype}, checkpointing {ac.mode}; none: {format_size(acts.plain)}, full: "
            f"{format_size(acts.full)})"
        )
    else:
        lines.append(f"  activations {'?':>10}  ({memory.activations_note})")
    if memory.host_state:
        lines.append(
            f"  total       {format_size(memory.total):>10}  (on the device: parameters, gradients and "
            "optimizer state are offloaded to the host)"
        )
        lines.append(
            f"  host        {format_size(memory.host_state):>10}  (trainer.memory.cpu_offload: parameters + "
            "gradients + optimizer state, pinned)"
        )
    else:
        lines.append(f"  total       {format_size(memory.total):>10}")
    if acts is not None:
        if acts.per_pp_rank:
            per_rank = ", ".join(f"pp rank {r}: {format_size(b)}" for r, b in enumerate(acts.per_pp_rank))
            lines.append(f"  activations per pp rank (checkpointing {ac.mode}): {per_rank}")
        lines.append(f"  activation estimate assumes: {_activation_assumptions(mesh, acts.in_flight_note)}")
    return lines


def _context_parallel_lines(sequence: "SequencePlan", cp: int) -> list[str]:
    """The cp groups (in cp-rank order) and each rank's share of a sequence, for a mesh with cp > 1."""
    chunks = 2 * cp
    groups = [list(g) for g in sequence.cp_groups]
    shown = ", ".join(_format_group(g) for g in groups[:4])
    more = f", … ({len(groups)} groups)" if len(groups) > 4 else ""
    layout = f"chunks r and {chunks - 1}−r of {chunks} for cp rank r"
    if sequence.share is None:
        share = (
            f"seq_len / {cp} tokens ({layout}); the sequence length is not known without loading data "
            f"({sequence.source}): pass --seq-len to check it"
        )
    else:
        s = sequence.share
        share = (
            f"{s.seq_len} / {cp} = {s.local_tokens} tokens ({layout}, {s.chunk_tokens} tokens each; "
            f"{s.seq_len} from {sequence.source})"
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


def _pipeline_lines(pipeline: "PipelinePlan", pipelining: "PipeliningConfig") -> list[str]:
    """The schedule, each pp rank's stages (global ranks, layers, embedding and head) and the bubble."""
    layout = pipeline.layout
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
    for rank in range(p):
        ranks = _format_ranks(list(pipeline.pp_ranks[rank]))
        chunks = "; ".join(f"stage {s.index}: {_stage_content(s)}" for s in layout.stages_of_rank(rank))
        lines.append(f"  pp rank {rank} (ranks {ranks}): {chunks}")
    return lines + _bubble_lines(pipeline)


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


def _bubble_lines(pipeline: "PipelinePlan") -> list[str]:
    """The schedule's theoretical bubble for this layout, the formula and what it assumes."""
    from d9d.parallel.pipeline import ZERO_BUBBLE_SCHEDULES

    layout, bubble, m = pipeline.layout, pipeline.bubble, pipeline.microbatches_per_step
    p, v, n = layout.pp_size, layout.stages_per_rank, layout.num_stages
    assumes = (
        "every stage takes the same time per microbatch; communication is free; theory, not a measurement"
    )
    if layout.config.schedule in ZERO_BUBBLE_SCHEDULES:
        assumes += "; the backward's input- and weight-gradient parts take as long as the forward"
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
            f"({bubble.formula} with p={p}, v={v}, m={m}; {bubble.source})"
        )
    return [f"  bubble: {head}", f"  bubble assumes: {assumes}"]


def _activation_assumptions(mesh: "MeshConfig", in_flight: str) -> str:
    """What the activation figure assumes, in one line (see `estimate_activations`)."""
    parts = ["attention saves what a fused (flash) kernel saves"]
    if mesh.context_parallel > 1:
        parts.append(
            f"each rank holds 1/{mesh.context_parallel} of the sequence, except the K/V that attention "
            "all-gathers (full length)"
        )
    if mesh.tensor_parallel > 1:
        parts.append(
            f"tensor parallel {mesh.tensor_parallel} as the model provider splits the model (what it "
            "keeps whole counts whole)"
        )
    if mesh.pipeline_parallel > 1:
        parts.append(f"this rank's stages; {in_flight}")
    return "; ".join(parts)
