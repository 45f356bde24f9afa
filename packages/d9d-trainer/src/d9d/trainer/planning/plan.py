"""What a job builds on one rank, as values: the plan `plan_job` decides, and its memory estimate.

Torch-light and free of the deciding code (`job_plan`, `memory`, `fit`), so whoever only reads a plan
(`RunControl.plan`, `d9d plan`'s printing) depends on these types and nothing that builds them.
"""

from dataclasses import dataclass

import torch

from d9d.mesh import MeshConfig
from d9d.parallel import AttentionKernel, Float8Selection, LoraCoverage, MixedPrecision, SequenceShare
from d9d.parallel.pipeline import PipelineBubble, PipelineLayout, StageSpec
from d9d.trainer.providers.data import Batching
from d9d.trainer.providers.optim import OptimizerStates

__all__ = [
    "ActivationEstimate",
    "JobPlan",
    "MemoryEstimate",
    "MemoryPlan",
    "PipelinePlan",
    "RankMemory",
    "SequencePlan",
]


@dataclass(frozen=True)
class SequencePlan:
    """The sequence length the job trains on, where that number comes from, and its context-parallel split.

    Attributes:
        seq_len: tokens per sample; None when not known without loading data.
        source: where `seq_len` came from (`dataset.seq_len`, `--seq-len`, ...), or why it is unknown.
        cp_groups: the global ranks of each cp group (mesh.context_parallel of them), in cp-rank order.
        share: this rank's share of a sequence (every cp rank holds as many tokens); None when
            `seq_len` is unknown.
        packed: the rows pack documents (the dataset's document masking, or the config's packing keys).
    """

    seq_len: int | None
    source: str
    cp_groups: tuple[tuple[int, ...], ...]
    share: SequenceShare | None
    packed: bool = False


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline layout (every stage and which pp rank runs it), this rank's stages, and the bubble.

    Attributes:
        layout: every stage, its layers and its pp rank, for the schedule.
        stages: the stages this rank builds and runs, in stage order.
        microbatches_per_step: what the schedule runs per step (the data provider's declaration).
        bubble: the schedule's theoretical bubble for those microbatches.
        pp_ranks: the global ranks of each pp rank (index: the pp coordinate).
    """

    layout: PipelineLayout
    stages: tuple[StageSpec, ...]
    microbatches_per_step: int
    bubble: PipelineBubble
    pp_ranks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of persistent training state on one rank.

    Attributes:
        shard_factor: how many ranks share one copy of every parameter (pp × dp_shard × cp × tp).
        optimizer_states: optimizer tensors kept per trainable parameter (AdamW 2, SGD 1 or 0).
        optimizer_state_bytes: bytes of one such tensor for every trainable parameter, whole model
            (the trainable parameters' bytes for states in the parameter's dtype, half of them in
            bfloat16).
    """

    params: int
    grads: int
    optimizer: int
    shard_factor: int
    optimizer_states: int
    optimizer_state_bytes: int = 0

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes saved for backward on one rank at the step's peak, without and with the job's checkpointing.

    Each figure is one microbatch's saved activations of every stage the rank runs, times the
    microbatches that stage holds in flight under the schedule (`in_flight`; 1 without pipeline
    parallelism).

    Attributes:
        plain: no activation checkpointing.
        checkpointed: with `trainer.activation_checkpointing` as configured (`plain` for `none`).
        full: with every block checkpointed.
        tokens: microbatch size × sequence length the forward ran on (this rank's share under cp).
        in_flight: per stage of this rank (stage order), the microbatches it holds at once.
        in_flight_note: how `in_flight` follows from the schedule ("" without pipeline parallelism).
        recompute: with checkpointing, what the backward of one checkpointed block holds recomputed
            for a moment on top of `checkpointed` (the bytes checkpointing spared that block, one
            microbatch); 0 for `none`. Counted in `peak`: an upper bound of the step's most.
        kv: of `checkpointed`, the full-length K and V that context parallelism's attention
            all-gathers and keeps for backward (0 without context parallelism).
        kv_layer: one layer's all-gathered K and V (one microbatch): what a checkpointed block holds
            of them while it recomputes.
    """

    plain: int
    checkpointed: int
    full: int
    tokens: str
    in_flight: tuple[int, ...] = (1,)
    in_flight_note: str = ""
    recompute: int = 0
    kv: int = 0
    kv_layer: int = 0

    @property
    def peak(self) -> int:
        """The most held for backward at once: `checkpointed` + one block's `recompute`."""
        return self.checkpointed + self.recompute


@dataclass(frozen=True)
class RankMemory:
    """What one pp rank needs under pipeline parallelism: its stages' state and their activations.

    The stages differ (the first holds the embedding, the last the head and the loss's logits, and
    the schedule keeps a different number of microbatches in flight on each), so every pp rank is
    counted from its own stages, not as 1/pp of the model.

    Attributes:
        pp_rank: the pipeline coordinate.
        stages: the stages it runs, in stage order.
        state: those stages' parameters, gradients and optimizer state on one of its ranks (split
            over dp_shard × cp × tp as `estimate_memory` assumes).
        activations: those stages' saved activations at the step's peak; None when not estimated.
        offloaded: whether `state` is kept in host memory (`trainer.memory.cpu_offload`).
        weight_copies: bytes of its stages' compute-dtype weight copies alive through a step (as
            `MemoryPlan.weight_copies`).
    """

    pp_rank: int
    stages: tuple[StageSpec, ...]
    state: MemoryEstimate
    activations: ActivationEstimate | None
    offloaded: bool = False
    weight_copies: int = 0

    @property
    def host_state(self) -> int:
        """Bytes of `state` in host memory (all of it with CPU offload, else 0)."""
        return self.state.total if self.offloaded else 0

    @property
    def total(self) -> int:
        """Device bytes: the state kept there, the weights' compute copies and the activations with the
        job's checkpointing."""
        acts = self.activations.peak if self.activations is not None else 0
        return self.state.total - self.host_state + self.weight_copies + acts


@dataclass(frozen=True)
class MemoryPlan:
    """The memory estimate of a plan, per rank.

    Counted on the whole model as the trainer shapes it (every pipeline stage), so with `peft.lora` the
    adapters are parameters and only they train: gradients and optimizer state are theirs alone.

    Attributes:
        parameters: parameters of the whole model (LoRA adapters included).
        param_bytes: bytes of the whole model's parameters (float32 master weights).
        trainable_bytes: bytes of its trainable parameters (`requires_grad`: with LoRA, the adapters).
        trainable_parameters: how many parameters those are.
        state: parameters, gradients and optimizer state on one rank: 1/`shard_factor` of the whole
            model (under pipeline parallelism the average pp rank's; each one's is in `pp_ranks`).
        activations: this rank's saved activations; None when they cannot be estimated.
        activations_note: why there is no activation estimate ("" when there is one).
        float8: the linears `trainer.precision.float8` converts and keeps (None without float8); the
            estimate counts them as without float8 (their weights, gradients and optimizer state
            stay float32; the float8 casts live only around each matmul).
        float8_all_gather: whether FSDP2 all-gathers those weights in float8 (as the trainer builds).
        host_state: bytes of `state` kept in host memory (`trainer.memory.cpu_offload`: all of it,
            as the trainer refuses an FSDP2 unit that does not offload); 0 without offload.
        lora: what each `peft.lora` pattern matched per layer and the projections it misses (None
            without `peft.lora`).
        pp_ranks: under pipeline parallelism, what every pp rank needs (index: pp coordinate); ()
            without.
        loss: which loss the last stage runs (`trainer.loss`): the fused head or the full logits.
        weight_copies: bytes of the compute-dtype copies of the weights alive through a step: cast
            once per step and kept for all its microbatches and recomputes (`d9d.parallel.
            weights_cast_once`; under DDP, FSDP2's unsharded copies, kept between microbatches); 0
            for float32 compute and for sharded parameters (FSDP gathers one unit at a time).
    """

    parameters: int
    param_bytes: int
    trainable_bytes: int
    trainable_parameters: int
    state: MemoryEstimate
    activations: ActivationEstimate | None
    activations_note: str
    float8: Float8Selection | None = None
    float8_all_gather: bool = False
    host_state: int = 0
    lora: LoraCoverage | None = None
    pp_ranks: tuple[RankMemory, ...] = ()
    loss: str = ""
    weight_copies: int = 0

    @property
    def device_state(self) -> int:
        """Bytes on the device through a step besides activations: `state` (all of it without CPU
        offload) and the weights' compute copies."""
        return self.state.total - self.host_state + self.weight_copies

    @property
    def peak(self) -> RankMemory | None:
        """Under pipeline parallelism the pp rank that needs the most device memory (the first of
        equals); None without."""
        return max(self.pp_ranks, key=lambda rank: rank.total) if self.pp_ranks else None

    @property
    def total(self) -> int:
        """Device bytes of the rank that needs the most: the state kept there plus the activations
        with the job's checkpointing (when estimated); under pipeline parallelism the `peak` pp
        rank's. What CPU offload keeps on the host (`host_state`) is not counted here."""
        peak = self.peak
        if peak is not None:
            return peak.total
        return self.device_state + (self.activations.peak if self.activations is not None else 0)


@dataclass(frozen=True)
class JobPlan:
    """What a job builds on one rank: layout, precision, batching, pipeline, sequence, vocabulary, memory.

    Attributes:
        mesh: the mesh degrees (layout: `d9d.mesh.format_layout(plan.mesh)`).
        rank: the global rank this plan is for (its pipeline stages, its share of a sequence).
        device: the device type the precision was resolved for.
        precision: compute and reduction dtypes (`trainer.precision` on `device`).
        batching: the data provider factory's declared batching; None when it declares none.
        pipeline: the pipeline plan; None without pipeline parallelism.
        sequence: the sequence length, its source and its cp split.
        vocab_size: the dataset's vocabulary (checked against the model's embedding); None unknown.
        optimizer_states: optimizer tensors per trainable parameter (declared, or assumed: its
            description says so).
        memory: the per-rank memory estimate, when asked for (`plan_job(..., memory=True)`).
        attention: the attention kernel (`trainer.attention.backend` on `device`) and why.
    """

    mesh: MeshConfig
    rank: int
    device: torch.device
    precision: MixedPrecision
    batching: Batching | None
    pipeline: PipelinePlan | None
    sequence: SequencePlan
    vocab_size: int | None
    optimizer_states: OptimizerStates
    memory: MemoryPlan | None = None
    attention: AttentionKernel | None = None

    @property
    def stages(self) -> tuple[StageSpec | None, ...]:
        """The model stages this rank builds: its pipeline stages, or (None,) for the whole model."""
        return self.pipeline.stages if self.pipeline is not None else (None,)


def full_logits_path(*, fused: bool, reason: str | None = None) -> str:
    """The loss path of a model whose head returns the full logits, and why (`trainer.loss.fused`, or
    `reason`: why the trainer did not fuse it, `d9d.trainer.build.model.applied_loss`)."""
    why = reason or ("the model does not fuse its head" if fused else "trainer.loss.fused: false")
    return f"full logits ({why})"
