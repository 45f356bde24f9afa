"""`ReferenceModelConfig`: the shape of the reference decoder, read from the `model:` section of a job.

Field names follow the Hugging Face Qwen3 / Qwen3-MoE configs where they exist, so a config can be
filled from (or exported to) a `config.json` almost key for key.
"""

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

__all__ = [
    "ClassificationHead",
    "EmbeddingHead",
    "HeadConfig",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "MoEBalancingConfig",
    "MoEConfig",
    "ReferenceModelConfig",
    "ReferenceModelConfigError",
    "RopeScaling",
    "SlidingWindowError",
    "YarnRopeScaling",
    "check_sequence_length",
]


class ReferenceModelConfigError(ValueError):
    """A reference-model config value is invalid; the message names the key and what to change.

    Raised from `__post_init__`, so `msgspec.convert`/`decode` reports it as a `ValidationError`
    carrying the same message plus the key path of the struct (e.g. `- at $.model`).
    """


class SlidingWindowError(ValueError):
    """Sequences longer than the sliding window: the reference model's full causal attention would
    differ from the windowed attention of the model it stands for (the message says what to change)."""


def _require_positive(**values: int | float) -> None:
    for key, value in values.items():
        if value <= 0:
            raise ReferenceModelConfigError(f"model.{key}={value} must be positive")


class _RopeScalingBase(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="rope_type"
):
    """RoPE scaling (the `model.rope_scaling` section), tagged by `rope_type`; the math is in `rope.py`."""


class LinearRopeScaling(_RopeScalingBase, tag="linear"):
    """Position interpolation: every frequency divided by `factor` (HF `rope_type: linear`).

    Attributes:
        factor: how many times longer the sequences are than those of pretraining.
    """

    factor: float

    def __post_init__(self) -> None:
        _require_positive(**{"rope_scaling.factor": self.factor})


class Llama3RopeScaling(_RopeScalingBase, tag="llama3"):
    """Llama 3.x: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.

    Attributes:
        factor: divisor of the low frequencies (8 in Llama 3.1).
        low_freq_factor: wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        high_freq_factor: wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        original_max_position_embeddings: context length of pretraining (8192 in Llama 3.1).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _require_positive(
            **{
                "rope_scaling.factor": self.factor,
                "rope_scaling.low_freq_factor": self.low_freq_factor,
                "rope_scaling.high_freq_factor": self.high_freq_factor,
                "rope_scaling.original_max_position_embeddings": self.original_max_position_embeddings,
            }
        )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ReferenceModelConfigError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor} (they bound the smoothed band)"
            )


class YarnRopeScaling(_RopeScalingBase, tag="yarn"):
    """YaRN: frequencies ramp from interpolated (÷ factor) to kept, and cos/sin are scaled (HF `rope_type: yarn`).

    Attributes:
        factor: how many times longer the sequences are than those of pretraining.
        original_max_position_embeddings: context length of pretraining.
        attention_factor: the cos/sin scale; None derives it from `factor` (and `mscale`, `mscale_all_dim`).
        beta_fast: rotations below which a dimension is interpolated entirely (ramp start).
        beta_slow: rotations above which a dimension is kept entirely (ramp end).
        mscale: with `mscale_all_dim`, the numerator's weight of log(factor) in the derived attention factor.
        mscale_all_dim: the denominator's weight.
        truncate: round the ramp's bounds to whole dimensions (floor / ceil).
    """

    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _require_positive(
            **{
                "rope_scaling.factor": self.factor,
                "rope_scaling.original_max_position_embeddings": self.original_max_position_embeddings,
                "rope_scaling.beta_fast": self.beta_fast,
                "rope_scaling.beta_slow": self.beta_slow,
            }
        )
        if self.attention_factor is not None:
            _require_positive(**{"rope_scaling.attention_factor": self.attention_factor})


#: The RoPE scalings the reference model computes exactly as transformers does (`model.rope_scaling`).
RopeScaling = LinearRopeScaling | Llama3RopeScaling | YarnRopeScaling


class MoEBalancingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the MoE layers are kept balanced (the `model.moe.balancing` section; all off by default).

    Attributes:
        aux_loss_coef: weight of the auxiliary load-balance loss (Switch Transformer) in the loss.
        z_loss_coef: weight of the router z-loss (ST-MoE) in the loss.
        bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the router's
            scores chooses the experts and moves by this much per step towards the less loaded ones.
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        values = {"aux_loss_coef": self.aux_loss_coef, "z_loss_coef": self.z_loss_coef,
                  "bias_update_rate": self.bias_update_rate}  # fmt: skip
        for key, value in values.items():
            if value < 0:
                raise ReferenceModelConfigError(f"model.moe.balancing.{key}={value} must be >= 0")


class MoEConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Mixture-of-experts feed-forward layers (the `model.moe` section).

    A layer i is an MoE layer when `layers` lists it, or, when `layers` is not set, when
    `(i + 1) % every_n_layers == 0` (Hugging Face's `decoder_sparse_step`). The others stay dense.

    Attributes:
        num_experts: routed experts per MoE layer.
        top_k: experts each token goes through.
        moe_intermediate_size: hidden width of each routed expert.
        every_n_layers: make every n-th layer an MoE layer (1: all of them).
        layers: explicit indices of the MoE layers; excludes a non-default `every_n_layers`.
        shared_expert_intermediate_size: hidden width of a shared expert that every token also goes
            through; None for no shared expert (Qwen3-MoE has none).
        norm_topk_prob: rescale each token's top-k router weights to sum to 1.
        balancing: auxiliary loss, router z-loss and the auxiliary-loss-free score bias (all off).
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    every_n_layers: int = 1
    layers: tuple[int, ...] | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    balancing: MoEBalancingConfig = msgspec.field(default_factory=MoEBalancingConfig)

    def __post_init__(self) -> None:
        _require_positive(
            **{
                "moe.num_experts": self.num_experts,
                "moe.top_k": self.top_k,
                "moe.moe_intermediate_size": self.moe_intermediate_size,
                "moe.every_n_layers": self.every_n_layers,
            }
        )
        if self.top_k > self.num_experts:
            raise ReferenceModelConfigError(
                f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}; lower top_k"
            )
        if self.layers is not None and self.every_n_layers != 1:
            raise ReferenceModelConfigError(
                "model.moe.layers and model.moe.every_n_layers are both set; give only one of them"
            )
        if self.shared_expert_intermediate_size is not None:
            _require_positive(**{"moe.shared_expert_intermediate_size": self.shared_expert_intermediate_size})

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` (0-based) uses the MoE feed-forward."""
        if self.layers is not None:
            return index in self.layers
        return (index + 1) % self.every_n_layers == 0


class _HeadBase(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind"):
    """What the model returns instead of next-token logits (the `model.head` section), tagged by `kind`."""


class ClassificationHead(_HeadBase, tag="classification"):
    """A sequence-classification head (transformers' `*ForSequenceClassification`): `score`, a
    Linear(hidden, num_labels, bias=False), on the hidden state of each row's last non-padding token.

    Attributes:
        num_labels: scores per sequence (1 for a reward model).
        pad_token_id: the padding token: a row's score is its rightmost token that is not this one
            (left or right padding alike, as transformers picks it); None: the last token of the row.
        id2label: label names for the exported config.json (default `LABEL_<i>`, as transformers').
    """

    num_labels: int
    pad_token_id: int | None = None
    id2label: dict[int, str] | None = None

    def __post_init__(self) -> None:
        if self.num_labels < 1:
            raise ReferenceModelConfigError(
                f"model.head.num_labels={self.num_labels} must be at least 1 (1 for a reward model)"
            )
        if self.id2label is not None and sorted(self.id2label) != list(range(self.num_labels)):
            raise ReferenceModelConfigError(
                f"model.head.id2label names labels {sorted(self.id2label)}; name each of 0..{self.num_labels - 1} once"
            )


#: The poolings an embedding head knows.
POOLINGS = ("last", "mean")


class EmbeddingHead(_HeadBase, tag="embedding"):
    """An embedding output: the final hidden states pooled per sequence, [batch, hidden].

    Attributes:
        pooling: "last" (the last non-padding token, picked as the classification head picks it) or
            "mean" (the mean over the non-padding tokens).
        normalize: scale each embedding to unit L2 norm.
        pad_token_id: the padding token (None: no token is padding).
    """

    pooling: str = "last"
    normalize: bool = True
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ReferenceModelConfigError(
                f"model.head.pooling={self.pooling!r} is not a pooling; use one of {', '.join(POOLINGS)}"
            )


#: The heads the reference model and the Hugging Face backend put on the decoder (`model.head`).
HeadConfig = ClassificationHead | EmbeddingHead


class ReferenceModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Shape and numerics of the Llama/Qwen3-style reference decoder.

    Attributes:
        vocab_size: rows of the embedding table and width of the logits.
        hidden_size: model width.
        intermediate_size: hidden width of the dense SwiGLU MLP.
        num_layers: decoder layers (Hugging Face: `num_hidden_layers`).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention); None means
            `num_attention_heads` (multi-head attention). Must divide `num_attention_heads`.
        head_dim: width of one head; None means `hidden_size // num_attention_heads`.
        rope_theta: RoPE base.
        rope_scaling: RoPE frequency scaling for long contexts (`rope_type`: linear, llama3 or yarn,
            with that type's keys); None for plain RoPE.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest sequence (and largest position id) the model is meant for.
        tie_word_embeddings: the LM head shares the embedding table.
        qk_norm: RMSNorm on each query and key head before RoPE (Qwen3); False gives Llama.
        qkv_bias: biases on the query, key and value projections, none on the output one (Qwen2).
        sliding_window: the attention window of the model this one stands for (Mistral, Mixtral, Qwen2
            with `use_sliding_window`): a query sees itself and the window − 1 tokens before it. The
            reference model attends to the whole sequence, which is the same computation only while a
            sequence has at most this many tokens: longer ones are refused (`check_sequence_length`).
            None: no window.
        hf_model_type: the Hugging Face `model_type` an export writes where more than one computes this
            model (`llama` or `mistral`); None: the default for the computation (`hf_model_type()`).
        initializer_range: std of the normal init of linears and the embedding.
        fp32_logits: return the logits in float32 whatever the parameter dtype.
        moe: mixture-of-experts layers; None for a dense model.
        head: a classification head or an embedding output instead of the LM head (`kind:
            classification` or `embedding`); None: a causal LM.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False
    sliding_window: int | None = None
    hf_model_type: Literal["llama", "mistral"] | None = None
    initializer_range: float = 0.02
    fp32_logits: bool = False
    moe: MoEConfig | None = None
    head: HeadConfig | None = None

    def __post_init__(self) -> None:
        _require_positive(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
        )
        if self.num_key_value_heads is not None:
            _require_positive(num_key_value_heads=self.num_key_value_heads)
            if self.num_attention_heads % self.num_key_value_heads != 0:
                raise ReferenceModelConfigError(
                    f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                    f"model.num_key_value_heads={self.num_key_value_heads}; each key/value head must "
                    "serve the same number of query heads"
                )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ReferenceModelConfigError(
                    f"model.hidden_size={self.hidden_size} is not divisible by "
                    f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim explicitly"
                )
        else:
            _require_positive(head_dim=self.head_dim)
        if self.attention_head_dim % 2 != 0:
            raise ReferenceModelConfigError(
                f"model.head_dim={self.attention_head_dim} must be even for RoPE "
                "(it rotates pairs of channels)"
            )
        if self.sliding_window is not None:
            _require_positive(sliding_window=self.sliding_window)
        if self.moe is not None and self.moe.layers is not None:
            outside = [i for i in self.moe.layers if not 0 <= i < self.num_layers]
            if outside:
                raise ReferenceModelConfigError(
                    f"model.moe.layers has {outside}, outside 0..{self.num_layers - 1} "
                    f"(model.num_layers={self.num_layers})"
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReferenceModelConfig":
        """Validate a plain mapping (e.g. the `model:` section of a YAML job) into a config."""
        return msgspec.convert(data, cls)

    @property
    def kv_heads(self) -> int:
        """Key/value heads, with the multi-head default applied."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """Width of one attention head, with the `hidden_size // num_attention_heads` default applied."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` uses the MoE feed-forward (False for every layer of a dense model)."""
        return self.moe is not None and self.moe.is_moe_layer(index)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for MFU: 6 × active non-embedding params + attention.

        Counts the LM head, the routed experts a token actually visits (top_k of them) and the
        attention score/value matmuls over the full (not causally halved) `seq_len`, as is customary.
        """
        h, d = self.hidden_size, self.attention_head_dim
        q, kv = self.num_attention_heads, self.kv_heads
        attention = h * d * (2 * q + 2 * kv)
        active = self.vocab_size * h if self.head is None else 0  # LM head (tied or not, its matmul runs)
        for index in range(self.num_layers):
            active += attention
            if self.is_moe_layer(index):
                assert self.moe is not None
                active += h * self.moe.num_experts  # router
                active += 3 * h * self.moe.moe_intermediate_size * self.moe.top_k
                if self.moe.shared_expert_intermediate_size is not None:
                    active += 3 * h * self.moe.shared_expert_intermediate_size
            else:
                active += 3 * h * self.intermediate_size
        return 6.0 * active + 12.0 * self.num_layers * q * d * seq_len


def check_sequence_length(
    config: ReferenceModelConfig, seq_len: int, *, key: str = "model.sliding_window"
) -> None:
    """Refuse sequences the reference model would not compute as the model it stands for: longer than
    its sliding window (a no-op without one).

    A model provider calls it from its `check_sequence_length` (d9d.trainer's `ChecksSequenceLength`
    ability: the plan then refuses the job before anything is built); the model's forward calls it too.

    Args:
        key: where the window was set, for the message: `model.sliding_window` (the job's model
            section), or e.g. `<folder>/config.json sliding_window` for a model read from an HF folder.

    Raises:
        SlidingWindowError: `seq_len` exceeds `config.sliding_window`.
    """
    window = config.sliding_window
    if window is not None and seq_len > window:
        raise SlidingWindowError(
            f"sequences of {seq_len} tokens are longer than {key}={window}: the reference model attends to the "
            f"whole sequence, which equals sliding-window attention only up to {window} tokens; use sequences "
            f"of at most {window} tokens (dataset.seq_len) or another backend (model.backend: hf)"
        )
