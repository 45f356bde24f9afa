"""The config sections of d9d-parallel's per-block mechanisms: precision, activation checkpointing,
compile, LoRA, memory (CPU offload), the fused LM-head loss and the attention kernel.

Plain msgspec structs, importing no torch, so a job's config is checked (unknown keys, wrong values)
before torch is imported; the code each one configures lives in its own module (`precision.py`,
`activation_checkpointing.py`, `compile.py`, `lora.py`), which re-exports it.
"""

import re
from typing import Literal

import msgspec

__all__ = [
    "ATTENTION_BACKENDS",
    "FLOAT8_KEY",
    "LORA_KEY",
    "ActivationCheckpointingConfig",
    "AttentionConfig",
    "CompileConfig",
    "Float8Config",
    "LoraConfig",
    "LossConfig",
    "MemoryConfig",
    "PrecisionConfig",
]

#: Where a job's config holds `LoraConfig` (its error messages name the key).
LORA_KEY = "peft.lora"
#: Where a job's config holds `Float8Config`.
FLOAT8_KEY = "trainer.precision.float8"


class Float8Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.precision.float8`: the linears whose matmuls run in float8 (torchao's float8 training).

    Attributes:
        recipe: `tensorwise` (one scale per tensor; under FSDP2 the weights are all-gathered in
            float8) or `rowwise` (a scale per row: closer to bfloat16, all-gathered in high precision).
        modules: a regular expression matched against each `nn.Linear`'s whole module path
            (`re.fullmatch`); the default takes every linear but the output layer (`lm_head`, or the
            model's `get_output_embeddings()`), which converts only when the expression spells its
            name (e.g. `'.*_proj|lm_head'`). Linears whose dimensions are not multiples of 16 stay
            as they are (float8 matmuls cannot take them); what stays is listed.
    """

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    modules: str = ".*"

    def gathers_float8(self, sharded: bool) -> bool:
        """Whether FSDP2 all-gathers the converted weights in float8: tensorwise on a sharded model."""
        return sharded and self.recipe == "tensorwise"

    def __post_init__(self) -> None:
        try:
            re.compile(self.modules)
        except re.error as error:
            raise ValueError(
                f"{FLOAT8_KEY}.modules is not a valid regex ({self.modules!r}: {error})"
            ) from None


class PrecisionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.precision`: the dtypes of compute and gradient reduction, TF32 and float8 linears.

    Attributes:
        param_dtype: dtype of parameters in forward/backward; `auto` is bfloat16 on CUDA and float32
            on CPU. Master weights and optimizer state always stay float32.
        reduce_dtype: dtype of data-parallel gradient reduction.
        tf32: TF32 tensor cores for the matmuls and convolutions that still run in float32 on CUDA.
        float8: float8 matmuls in the chosen linears (`Float8Config`; needs d9d-parallel's `float8`
            extra, torchao); None (default): none.
    """

    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    tf32: bool = True
    float8: Float8Config | None = None


class MemoryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.memory`: where the training state of FSDP2 units lives.

    Attributes:
        cpu_offload: keep the parameters, gradients and optimizer state of every FSDP2 unit on the
            host (FSDP2's `CPUOffloadPolicy`, in pinned memory on CUDA): each unit's parameters are
            copied to the device for its forward and backward, its sharded gradients back to the
            host, and the optimizer steps on the host. Needs sharded parameters
            (`mesh.data_parallel_shard` or `mesh.context_parallel` > 1); pass it to
            `parallelize_hsdp` / `parallelize_fsdp` (`cpu_offload=`).
    """

    cpu_offload: bool = False


class LossConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.loss`: how a causal LM's token loss is computed.

    Attributes:
        fused: the LM head and the cross-entropy computed together over chunks of tokens
            (`linear_cross_entropy`), so no [tokens, vocab] logits tensor exists; the same loss and
            gradients within float rounding. It applies where the model's head can
            (`fused_head_problem`); false: the model returns the full logits and the loss is computed
            from them in float32.
        chunk_size: tokens per chunk; at most chunk_size × vocab (÷ tp) logits are alive at once.
    """

    fused: bool = True
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(
                f"trainer.loss.chunk_size must be >= 1 (tokens per chunk), got {self.chunk_size}"
            )


class ActivationCheckpointingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.activation_checkpointing`: which transformer blocks recompute their activations.

    Attributes:
        mode: `none` keeps every activation; `full` checkpoints every block; `selective` every
            `every`-th block (blocks 0, every, 2·every, ...); `op` checkpoints every block per
            operation: the outputs of its matmuls, attention and collectives are kept, the cheap ops
            between them (norms, activations, elementwise, RoPE) recomputed (`op_checkpoint_policy`).
        every: the period of `selective`.
    """

    mode: Literal["none", "full", "selective", "op"] = "none"
    every: int = 2

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"trainer.activation_checkpointing.every must be >= 1, got {self.every}")


class CompileConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.compile`: compile each transformer block with `torch.compile` (inductor).

    Attributes:
        enabled: compile, or run eagerly.
        fullgraph: fail on a graph break instead of falling back to eager for that part.
        dynamic: None (default): each block compiles for the first shapes it sees, and a second
            shape (another sequence length: an eval set's, a short last batch) recompiles it once
            with the sizes that changed dynamic, which every later shape reuses. False: one graph
            per shape, and past torch's recompile limit (8) a block silently runs eagerly. True:
            dynamic from the first graph (one graph, but a one-length run loses the static one).
    """

    enabled: bool = False
    fullgraph: bool = False
    dynamic: bool | None = None


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`peft.lora`: low-rank adapters on the `nn.Linear` modules whose path matches a pattern.

    Attributes:
        rank: inner dim r of the adapters (A is [r, in], B is [out, r]).
        alpha: the update is scaled by alpha / rank.
        dropout: dropout probability on the adapter's input (the base path sees x unchanged).
        target_modules: regular expressions, each matched against the whole module path
            (`re.fullmatch`), e.g. `.*\\.(q_proj|v_proj)$`; a module is adapted when any matches.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: [r".*\.(q_proj|v_proj)"])

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"{LORA_KEY}.rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"{LORA_KEY}.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{LORA_KEY}.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError(f"{LORA_KEY}.target_modules must list at least one module-path regex")
        for index, pattern in enumerate(self.target_modules):
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"{LORA_KEY}.target_modules[{index}] is not a valid regex ({pattern!r}: {error})"
                ) from None

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the adapter's output."""
        return self.alpha / self.rank


#: The names `trainer.attention.backend` takes.
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math", "flex")


class AttentionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.attention`: which kernel computes the model's attention.

    Attributes:
        backend: `auto` (chosen for the device and compute dtype, with the reason in the plan and the
            "job built" line), one of torch's SDPA kernels (`flash`, `cudnn`, `efficient`, `math`: that
            kernel alone), or `flex` (FlexAttention). A kernel the device, the dtype, the mesh or the
            mask cannot run is refused before anything is built (`d9d.parallel.resolve_attention`).
        balance_documents: under context parallelism, reorder the whole documents of each packed row
            (a batch with `document_ids` and `position_ids`) before the row is cut into the 2·cp
            chunks, so every cp rank computes about the same attention pairs
            (`d9d.parallel.balanced_document_order`); the loss is the same sum. Off: rows as packed.
    """

    backend: Literal["auto", "flash", "cudnn", "efficient", "math", "flex"] = "auto"
    balance_documents: bool = False
