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

__all__ = ["ActivationEstimate", "JobPlan", "MemoryEstimate", "MemoryPlan", "PipelinePlan", "SequencePlan"]


@dataclass(frozen=True)
class SequencePlan:
    """The sequence length the job trains on, where that number comes from, and its context-parallel split.

    Attributes:
        seq_len: tokens per sample; None when not known without loading data.
        source: where `seq_len` came from (`dataset.seq_len`, `--seq-len`, ...), or why it is unknown.
        cp_groups: the global ranks of each cp group (mesh.context_parallel of them), in cp-rank order.
        share: this rank's share of a sequence (every cp rank holds as many tokens); None when
            `seq_len` is unknown.
    """

    seq_len: int | None
    source: str
    cp_groups: tuple[tuple[int, ...], ...]
    share: SequenceShare | None


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
        per_pp_rank: under pipeline parallelism, `checkpointed` of every pp rank (index: pp
            coordinate), whose stages and microbatches in flight differ; () without.
    """

    plain: int
    checkpointed: int
    full: int
    tokens: str
    in_flight: tuple[int, ...] = (1,)
    in_flight_note: str = ""
    per_pp_rank: tuple[int, ...] = ()


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
        state: parameters, gradients and optimizer state on one rank.
        activations: one microbatch's saved activations; None when they cannot be estimated.
        activations_note: why there is no activation estimate ("" when there is one).
        float8: the linears `trainer.precision.float8` converts and keeps (None without float8); the
            estimate counts them as without float8 (their weights, gradients and optimizer state
            stay float32; the float8 casts live only around each matmul).
        float8_all_gather: whether FSDP2 all-gathers those weights in float8 (as the trainer builds).
        host_state: bytes of `state` kept in host memory (`trainer.memory.cpu_offload`: all of it,
            as the trainer refuses an FSDP2 unit that does not offload); 0 without offload.
        lora: what each `peft.lora` pattern matched per layer and the projections it misses (None
            without `peft.lora`).
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

    @property
    def device_state(self) -> int:
        """Bytes of `state` on the device (all of it without CPU offload)."""
        return self.state.total - self.host_state

    @property
    def total(self) -> int:
        """Device bytes: the state kept there plus the activations with the job's checkpointing (when
        estimated). What CPU offload keeps on the host is `host_state`, not counted here."""
        return self.device_state + (self.activations.checkpointed if self.activations is not None else 0)

    @property
    def peak_total(self) -> int:
        """`total` of the rank that needs the most: under pipeline parallelism the pp rank with the most
        activations (every rank holds as much state), else this rank's."""
        acts = self.activations
        if acts is None or not acts.per_pp_rank:
            return self.total
        return self.device_state + max(acts.per_pp_rank)


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
