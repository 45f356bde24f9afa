"""The text of `d9d plan`: each section of a `JobPlan` (layout, data, cp, pipeline, precision, memory)
and the fit verdict, as lines. Formatting only: the numbers are the trainer's (`d9d.trainer.planning.plan_job`,
`plan_fit`)."""

import itertools
from typing import TYPE_CHECKING

from d9d.cli.commands._text import format_size
from d9d.mesh import format_ranks

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.mesh import MeshConfig
    from d9d.parallel.pipeline import StageSpec
    from d9d.trainer import JobConfig
    from d9d.trainer.config.job import PipeliningConfig
    from d9d.trainer.planning import (
        ActivationEstimate,
        FitPlan,
        JobPlan,
        PipelinePlan,
        RankMemory,
        SequencePlan,
    )

__all__ = ["format_fit", "plan_lines"]


def plan_lines(job_plan: "JobPlan", config: "JobConfig") -> list[str]:
    """Every section of the plan: layout, data, cp, pipeline, precision, model and memory."""
    from d9d.mesh import format_layout

    mesh = job_plan.mesh
    lines = [format_layout(mesh), _data_line(job_plan, config.providers.data)]
    if mesh.context_parallel > 1:
        lines += _context_parallel_lines(job_plan.sequence, mesh.context_parallel)
        lines += _packed_balance_line(job_plan.sequence, config.trainer.attention.balance_documents)
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
    ac_text = ac.mode + {
        "selective": f" (every {ac.every} blocks)",
        "op": " (every block keeps its matmul and attention outputs, recomputes the rest)",
    }.get(ac.mode, "")
    lines = [
        f"precision: compute {compute}{auto}, reduce {prec.reduce_dtype}, master weights float32, "
        f"optimizer states {_state_dtype(job_plan)}; tf32 {'on' if prec.tf32 else 'off'}",
        f"activation checkpointing: {ac_text}; compile: {'on' if tcfg.compile.enabled else 'off'}",
    ]
    if job_plan.attention is not None:
        lines.append(f"attention: {job_plan.attention.describe()}")
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
    """The memory estimate of the rank that needs the most: its state, activations and total (under
    pipeline parallelism the `peak` pp rank's, named, then every pp rank's total)."""
    memory = job_plan.memory
    assert memory is not None
    peak = memory.peak
    state, acts = (peak.state, peak.activations) if peak is not None else (memory.state, memory.activations)
    host = peak.host_state if peak is not None else memory.host_state
    lines = [
        *_model_lines(job_plan, config),
        _memory_header(job_plan, peak),
        f"  parameters  {format_size(state.params):>10}",
        f"  gradients   {format_size(state.grads):>10}",
        f"  optimizer   {format_size(state.optimizer):>10}  ({_states_text(job_plan)})",
    ]
    copies = peak.weight_copies if peak is not None else memory.weight_copies
    if copies:
        compute = str(job_plan.precision.param_dtype).removeprefix("torch.")
        lines.append(
            f"  weight copies {format_size(copies):>8}  ({compute}, cast once per step and kept for its microbatches)"
        )
    lines.append(_activations_line(job_plan, config, acts, memory.activations_note))
    if acts is not None and acts.kv_layer:
        lines.append(_kv_line(acts))
    whose = f"pp rank {peak.pp_rank}, the most of any rank" if peak is not None else ""
    if host:
        on_device = "on the device: parameters, gradients and optimizer state are offloaded to the host"
        lines.append(
            f"  total       {format_size(memory.total):>10}  ({'; '.join(filter(None, [whose, on_device]))})"
        )
        lines.append(
            f"  host        {format_size(host):>10}  (trainer.memory.cpu_offload: parameters + "
            "gradients + optimizer state, pinned)"
        )
    else:
        lines.append(f"  total       {format_size(memory.total):>10}" + (f"  ({whose})" if whose else ""))
    if peak is not None:
        ranks = ", ".join(
            f"pp rank {r.pp_rank}: {format_size(r.total)} ({_stage_names(r.stages)})" for r in memory.pp_ranks
        )
        lines.append(f"  total per pp rank (state + activations): {ranks}")
    if acts is not None:
        note = acts.in_flight_note
        lines.append(f"  activation estimate assumes: {_activation_assumptions(job_plan.mesh, note)}")
    if memory.loss:
        lines.append(f"  loss: {memory.loss} (trainer.loss)")
    return lines


def _memory_header(job_plan: "JobPlan", peak: "RankMemory | None") -> str:
    """What the per-rank figures below it are: 1/N of the model, or the named pp rank's stages."""
    mesh = job_plan.mesh
    split = f"dp_shard {mesh.data_parallel_shard} × cp {mesh.context_parallel} × tp {mesh.tensor_parallel}"
    if peak is None:
        factor = job_plan.memory.state.shard_factor if job_plan.memory is not None else 1
        return f"memory per rank (estimate; 1/{factor} of the model: pp {mesh.pipeline_parallel} × {split}):"
    stages = "; ".join(f"stage {s.index}: {_stage_content(s)}" for s in peak.stages)
    return (
        f"memory per rank (estimate; pp rank {peak.pp_rank}, which needs the most: {stages}, split over "
        f"{split}):"
    )


def _stage_names(stages: "tuple[StageSpec, ...]") -> str:
    """`stage 1`, `stages 0, 3`."""
    indices = ", ".join(str(s.index) for s in stages)
    return f"stage{'s' if len(stages) > 1 else ''} {indices}"


def _activations_line(
    job_plan: "JobPlan", config: "JobConfig", acts: "ActivationEstimate | None", note: str
) -> str:
    """One microbatch's saved activations (times those in flight), with none and full checkpointing."""
    if acts is None:
        return f"  activations {'?':>10}  ({note})"
    compute = str(job_plan.precision.param_dtype).removeprefix("torch.")
    flight = ""
    if any(n > 1 for n in acts.in_flight):
        flight = f" × {'+'.join(str(n) for n in acts.in_flight)} in flight"
    dtype = compute
    if config.trainer.precision.param_dtype == "auto":
        dtype = f"{compute}, the auto dtype on CUDA (a CPU run computes in float32: about 2×)"
    ac = config.trainer.activation_checkpointing
    recompute = f"; + {format_size(acts.recompute)} while a block recomputes" if acts.recompute else ""
    return (
        f"  activations {format_size(acts.peak):>10}  (one microbatch of {acts.tokens} tokens"
        f"{flight} in {dtype}, checkpointing {ac.mode}{recompute}; none: {format_size(acts.plain)}, full: "
        f"{format_size(acts.full)})"
    )


def _kv_line(acts: "ActivationEstimate") -> str:
    """Of the activations' peak, the full-length K and V context parallelism's attention all-gathers:
    those the layers not checkpointed keep, and the recomputing block's."""
    held = acts.kv + (acts.kv_layer if acts.recompute else 0)
    return (
        f"    of which K/V {format_size(held):>7}  (the full-length K and V attention all-gathers, "
        f"{format_size(acts.kv_layer)} a layer: kept by each layer not checkpointed and by the block "
        "that recomputes)"
    )


def _model_lines(job_plan: "JobPlan", config: "JobConfig") -> list[str]:
    """The parameters and the trainable ones; with `peft.lora`, what its patterns matched per layer and
    the warning the trainer's "job built" line gives."""
    memory = job_plan.memory
    assert memory is not None
    trainable = (
        "all trainable"
        if memory.trainable_parameters == memory.parameters
        else f"{memory.trainable_parameters:,} trainable, {format_size(memory.trainable_bytes)}"
    )
    lines = [f"model: {memory.parameters:,} parameters, {format_size(memory.param_bytes)} ({trainable})"]
    lora, coverage = config.peft.lora, memory.lora
    if lora is not None and coverage is not None:
        lines.append(
            f"lora: rank {lora.rank}, alpha {lora.alpha:g}; only the adapters train; "
            f"matched: {coverage.describe()}"
        )
        warning = coverage.warning()
        if warning is not None:
            lines.append(f"  warning: {warning}")
    return lines


def _context_parallel_lines(sequence: "SequencePlan", cp: int) -> list[str]:
    """The cp groups (in cp-rank order) and each rank's share of a sequence, for a mesh with cp > 1."""
    chunks = 2 * cp
    groups = [list(g) for g in sequence.cp_groups]
    shown = ", ".join(format_ranks(g) for g in groups[:4])
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


def _packed_balance_line(sequence: "SequencePlan", balance_documents: bool) -> list[str]:
    """One line for packed rows under cp: the attention balance over the cp ranks depends on the data."""
    if not sequence.packed:
        return []
    if balance_documents:
        how = (
            "documents reordered within each row (trainer.attention.balance_documents): <= 1.08× the mean "
            "measured at cp 2, and at cp 4-8 with 8 rows per microbatch (1.2-1.5× with one)"
        )
    else:
        how = "1.1-1.9× the mean with skewed lengths; trainer.attention.balance_documents: true evens it"
    return [
        f"  attention balance (packed rows): depends on the documents' lengths; {how}; per step: cp_attention_balance"
    ]


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
        return format_ranks(ranks)
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
        parts.append(f"that pp rank's stages; {in_flight}")
    return "; ".join(parts)


def format_fit(fit: "FitPlan", source: str) -> list[str]:
    """The fit verdict against `source`'s memory and, when it does not fit, each lever re-planned."""
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
