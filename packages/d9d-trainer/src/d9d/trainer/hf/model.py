"""`HFCausalLM`: a transformers causal LM as the trainer drives it, under Hugging Face's own names.

The trainer's task calls `model(input_ids, position_ids=..., document_ids=...)` and takes logits (or,
with `labels=`, the loss of a fused head: `fuse_head_loss`); a transformers model returns a `ModelOutput`. `HFCausalLM` is the thin module between them: it
registers the transformers model's children (`model`, `lm_head`) as its own, so every parameter,
checkpoint key, export key and LoRA adapter path is the Hugging Face one (`model.layers.0.self_attn.
q_proj.weight`), and keeps the transformers model itself unregistered, only to run its forward.

Packed documents: transformers keeps the documents of a row apart by their `position_ids` (a
position that does not follow the one before starts a new document, for every attention
implementation), which is exactly d9d.data's packing (positions restart at 0 in every document and
in the padding). So `position_ids` is what reaches the model and `document_ids` only has to come
with it; under context parallelism the documents are kept apart by `document_ids` instead (the
chunks of a row are on several ranks: `hf.context_parallel.batch_mask`).
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from d9d.parallel import LinearCrossEntropyHead, LossConfig, fuse_linear_cross_entropy, fused_head_problem
from d9d.trainer.hf.context_parallel import MASK_KEYWORD, batch_mask
from d9d.trainer.hf.errors import HFModelError
from d9d.trainer.hf.heads import HEAD_ONLY_KEYS, LM_HEAD_PATTERN, head_weight
from d9d.trainer.models.config import ClassificationHead, EmbeddingHead, HeadConfig
from d9d.trainer.models.heads import pool

__all__ = [
    "FUSED_LOSS_ARCHITECTURES",
    "HFCausalLM",
    "HFStateLayout",
    "base_model_path",
    "fuse_head_loss",
    "fused_loss_problem",
    "state_layout",
    "unwrap",
]

#: The architectures (config.json's model_type) whose causal LM's logits are `lm_head(last hidden
#: state)`, soft-capped where the config sets `final_logit_softcapping` (read in transformers 5.24's
#: modeling code), so the fused head computes their loss (tests/hf/test_hf_fused_loss.py: transformers'
#: own loss within 1e-6). Others keep the full logits: their heads scale or transform the logits.
FUSED_LOSS_ARCHITECTURES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "phi3", "olmo2", "gemma2", "gemma3_text"}
)


@dataclass(frozen=True)
class HFStateLayout:
    """The state-dict keys of a transformers model as built, and how Hugging Face stores them.

    Attributes:
        keys: every state-dict key, tied aliases included, in the model's order.
        tied: alias → the key Hugging Face stores that shared tensor under (e.g. `lm_head.weight` →
            `model.embed_tokens.weight` with `tie_word_embeddings`).
        unsaved_buffers: the names of the model's non-persistent buffers (rotary frequencies, scales):
            never saved by transformers, though old folders may hold them.
        ignore_unexpected: transformers' patterns of folder keys to ignore when loading
            (`_keys_to_ignore_on_load_unexpected`).
        optional: keys a folder may lack, which then keep their init (a classifier's `score.weight`
            on a causal LM's folder).
    """

    keys: tuple[str, ...]
    tied: dict[str, str]
    unsaved_buffers: frozenset[str]
    ignore_unexpected: tuple[str, ...] = ()
    optional: frozenset[str] = frozenset()

    @property
    def stored_keys(self) -> tuple[str, ...]:
        """The keys a Hugging Face folder holds: every key but the aliases of tied tensors."""
        return tuple(k for k in self.keys if k not in self.tied)

    def is_ignorable(self, key: str) -> bool:
        """Whether a folder key the model does not hold is one transformers ignores on load: a
        non-persistent buffer an old export saved (`...rotary_emb.inv_freq`), or one of its patterns."""
        return key.rpartition(".")[2] in self.unsaved_buffers or any(
            re.search(pattern, key) for pattern in self.ignore_unexpected
        )


def state_layout(model: PreTrainedModel) -> HFStateLayout:
    """The layout of `model` (on any device, meta included), as its class declares it."""
    state = model.state_dict(keep_vars=True)
    ties_declared = getattr(model, "_tied_weights_keys", None)
    aliases = set(ties_declared) if isinstance(ties_declared, dict) else set()
    users: dict[int, list[str]] = {}
    for key, tensor in state.items():
        users.setdefault(id(tensor), []).append(key)
    tied: dict[str, str] = {}
    for keys in users.values():
        if len(keys) > 1:  # a shared tensor: stored under its first key that is not a declared alias
            stored = next((k for k in keys if k not in aliases), keys[0])
            tied.update((k, stored) for k in keys if k != stored)
    unsaved = {name for module in model.modules() for name in module._non_persistent_buffers_set}
    return HFStateLayout(
        keys=tuple(state),
        tied=tied,
        unsaved_buffers=frozenset(unsaved),
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
    )


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward returns the logits tensor, with Hugging Face's parameter names.

    Args:
        model: a transformers `*ForCausalLM` (built on the meta device by the provider), or with
            `head` its `*ForSequenceClassification` (`d9d.trainer.hf.heads.build_head_model`).
        fp32_logits: return float32 logits whatever the compute dtype.
        head: the forward returns [sequences, num_labels] scores or [sequences, hidden] embeddings
            (`d9d.trainer.models.ClassificationHead`, `EmbeddingHead`) instead of logits.

    Raises:
        HFModelError: the model's root module holds tensors of its own (every causal LM of
            transformers keeps them in its children).
    """

    def __init__(
        self, model: PreTrainedModel, *, fp32_logits: bool = False, head: HeadConfig | None = None
    ) -> None:
        super().__init__()
        own = [name for name, t in (*model._parameters.items(), *model._buffers.items()) if t is not None]
        if own:
            raise HFModelError(
                f"{type(model).__name__} holds tensors on its root module ({', '.join(own)}), which the "
                "Hugging Face backend does not train; use the reference model or a provider of its own"
            )
        object.__setattr__(self, "_hf", model)  # not a submodule: its children below are ours
        for name, child in model.named_children():
            self.add_module(name, child)
        self.fp32_logits = fp32_logits
        #: the cp group once `apply_context_parallel` gave it (the forward then passes global positions)
        self.context_parallel: Any = None
        self.head = head
        self.layout = state_layout(model)
        if head is not None:  # a causal LM's folder: its LM head unread, the score from its init
            self.layout = replace(
                self.layout,
                ignore_unexpected=(*self.layout.ignore_unexpected, LM_HEAD_PATTERN),
                optional=HEAD_ONLY_KEYS & set(self.layout.keys),
            )
        self._flops_terms = _flops_terms(model)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The transformers model (sharing every module and parameter with this one)."""
        return self._hf

    @property
    def config(self) -> PretrainedConfig:
        """The transformers config the model was built from."""
        return self._hf.config

    @property
    def fused_loss_chunk_size(self) -> int | None:
        """Tokens per chunk when the LM head computes the loss fused (`fuse_head_loss`); else None."""
        head = self._hf.get_output_embeddings()
        return head.chunk_size if isinstance(head, LinearCrossEntropyHead) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` [batch, seq] → logits [batch, seq, vocab].

        Args:
            position_ids: [batch, seq] positions; for packed rows they restart at 0 in every document,
                which is how transformers keeps the documents apart.
            document_ids: [batch, seq] document of each token (packed rows): only accepted with
                `position_ids`, which carry the same boundaries; context parallelism masks by them.
            labels: [batch, seq], already shifted (-100 adds nothing): with a fused head, the summed
                token cross-entropy (float32, 0-dim) instead of the logits: the base model's hidden
                states through the head's fused loss, no full-vocabulary logits made.

        Raises:
            HFModelError: `document_ids` without `position_ids`; `labels` without a fused head.
        """
        if document_ids is not None and position_ids is None:
            raise HFModelError(
                "the batch has document_ids but no position_ids: the Hugging Face backend keeps packed "
                "documents apart by their position_ids (restarting at 0 in every document, as d9d.data's "
                "packed datasets yield them); add position_ids to the batch"
            )
        cp = self.context_parallel
        extra: dict[str, Any] = {}
        if cp is not None and cp.enabled:
            if position_ids is None:  # the chunks' global positions
                local = cp.position_ids(input_ids.size(1) * cp.size, device=input_ids.device)
                position_ids = local.unsqueeze(0).expand(input_ids.size(0), -1)
            mask = batch_mask(self.config, cp, input_ids, document_ids)  # documents, windows: once a batch
            if mask is not None:
                extra[MASK_KEYWORD] = mask
        if self.head is not None:
            return self._head_output(input_ids, position_ids, document_ids, extra)
        if labels is not None:
            return self._fused_loss(input_ids, position_ids, labels, extra)
        output = self._hf(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        logits: torch.Tensor = output.logits
        return logits.float() if self.fp32_logits else logits

    def _head_output(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        document_ids: torch.Tensor | None,
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """The head's [sequences, num_labels] scores (transformers' own forward for unpacked rows) or
        [sequences, hidden] embeddings, pooled per row or per packed document as the reference model does."""
        head, score = self.head, head_weight(self._hf)
        if isinstance(head, ClassificationHead) and document_ids is None:
            out: torch.Tensor = self._hf(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
            ).logits
        else:
            base = self.get_submodule(self.base_model_path)
            states = base(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
            ).last_hidden_state
            pooling = head.pooling if isinstance(head, EmbeddingHead) else "last"
            pad = self.config.get_text_config().pad_token_id
            out = pool(states, input_ids, pooling=pooling, pad_token_id=pad, document_ids=document_ids)
            if score is not None:
                out = score(out)
            elif isinstance(head, EmbeddingHead) and head.normalize:
                out = F.normalize(out.float(), dim=-1).to(out.dtype)
        return out.float() if self.fp32_logits else out

    def _fused_loss(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor,
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """What the causal LM's forward computes before its head, then the head's fused loss."""
        head = self._hf.get_output_embeddings()
        if not isinstance(head, LinearCrossEntropyHead) or not self.base_model_path:
            raise HFModelError(
                "labels were given but the LM head computes no loss: fuse it with fuse_head_loss "
                "(trainer.loss.fused), or compute the loss from the logits"
            )
        base = self.get_submodule(self.base_model_path)
        output = base(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        loss: torch.Tensor = head(output.last_hidden_state, labels=labels)
        return loss

    def train(self, mode: bool = True) -> "HFCausalLM":
        """Set training mode on every module, the unregistered transformers root included."""
        super().train(mode)
        self._hf.training = mode
        return self

    @property
    def base_model_path(self) -> str:
        """The module path of the transformers base model (`base_model_prefix`, e.g. "model"), which
        transformers' parallel plans (`config.base_model_tp_plan`) name their modules under; "" when
        the causal LM is its own base model."""
        return base_model_path(type(self._hf), dict(self.named_children()))

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (Hugging Face's accessor; the trainer checks the data's vocabulary with it)."""
        return self._hf.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head."""
        return self._hf.get_output_embeddings()

    def final_norm(self) -> nn.Module | None:
        """The norm before the LM head: the base model's `norm` (the name every family d9d tests gives
        it), or None when it has none of that name (then it stays in the root FSDP unit)."""
        base = self.get_submodule(self.base_model_path) if self.base_model_path else self
        norm = base._modules.get("norm")
        return norm if isinstance(norm, nn.Module) else None

    def decoder_layers(self) -> list[nn.Module]:
        """The model's decoder layers: the outermost modules of the classes transformers keeps whole
        (`_no_split_modules`), in order; what FSDP, activation checkpointing and compile act on."""
        names = set(getattr(self._hf, "_no_split_modules", None) or ())
        found: list[tuple[str, nn.Module]] = []
        for path, module in self.named_modules():
            if type(module).__name__ in names and not any(path.startswith(p + ".") for p, _ in found):
                found.append((path, module))
        return [module for _, module in found]

    def initialize_module(self, path: str, module: nn.Module) -> None:
        """d9d's materialization hook: transformers' own `_init_weights` on `module` (an unsharded copy).

        It also computes what no checkpoint holds, the non-persistent buffers (rotary frequencies,
        embedding scales), which is checked: a buffer it leaves unset is refused, not trained on.

        Raises:
            HFModelError: `_init_weights` left a non-persistent floating-point buffer unset.
        """
        unsaved = [
            name
            for name in module._non_persistent_buffers_set
            if module._buffers.get(name) is not None and module._buffers[name].is_floating_point()
        ]
        for name in unsaved:
            module._buffers[name].fill_(float("nan"))
        self._hf._init_weights(module)
        for name in unsaved:
            if bool(torch.isnan(module._buffers[name]).all()):
                raise HFModelError(
                    f"transformers' {type(self._hf).__name__}._init_weights does not compute the buffer "
                    f"{path}.{name} ({type(module).__name__}), and no checkpoint holds it; this "
                    "architecture cannot be built on the meta device here"
                )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token for MFU: 6 × the parameters a token's matmuls use (the LM head
        included, the input embedding not; of the experts, top-k of them) + the attention scores and
        values over the full `seq_len`."""
        matmul, attention = self._flops_terms
        return 6.0 * matmul + 12.0 * attention * seq_len


def fused_loss_problem(model: HFCausalLM) -> str | None:
    """Why `model`'s head cannot compute the loss fused (None when it can)."""
    model_type = model.config.model_type
    if model_type not in FUSED_LOSS_ARCHITECTURES:
        return f"model_type {model_type!r} is not one whose logits are verified to be lm_head(hidden states)"
    if not model.base_model_path:
        return "the causal LM has no base model to take hidden states from"
    return fused_head_problem(model.get_output_embeddings())


def fuse_head_loss(model: HFCausalLM, config: LossConfig) -> str | None:
    """With `config.fused` (`trainer.loss`), make the LM head compute the loss fused over chunks of
    `config.chunk_size` tokens, soft-capped as the architecture caps its logits; call it before
    `parallelize_decoder`. Returns why the head stays unfused (None when fused or not asked)."""
    if not config.fused:
        return None
    problem = fused_loss_problem(model)
    if problem is None:
        softcap = getattr(model.config, "final_logit_softcapping", None)
        fuse_linear_cross_entropy(
            model.get_output_embeddings(), chunk_size=config.chunk_size, softcap=softcap
        )
    return problem


def _flops_terms(model: PreTrainedModel) -> tuple[float, float]:
    """(parameters a token's matmuls use, layers × heads × head dim) of `model`, from its shapes."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = (
        getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or getattr(config, "n_routed_experts", None)
    )
    expert_share = top_k / experts if isinstance(top_k, int) and isinstance(experts, int) and experts else 1.0
    matmul = 0.0
    for name, param in model.named_parameters():
        if embedding is not None and param is getattr(embedding, "weight", None):
            continue
        matmul += param.numel() * (expert_share if ".experts." in name else 1.0)
    if head is not None and embedding is not None and head.weight is getattr(embedding, "weight", None):
        matmul += head.weight.numel()  # tied: counted once above as the embedding, but its matmul runs
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // max(heads, 1))
    return matmul, float(getattr(config, "num_hidden_layers", 0) * heads * head_dim)


def base_model_path(model_class: type[PreTrainedModel], children: Mapping[str, object] | None = None) -> str:
    """The base model's module path in a causal LM of `model_class` (its `base_model_prefix`), or ""
    when `children` (the causal LM's, if known) has no module of that name."""
    prefix = str(getattr(model_class, "base_model_prefix", "") or "")
    return prefix if children is None or prefix in children else ""


def unwrap(model: Any) -> HFCausalLM:
    """`model` as the `HFCausalLM` the provider built (FSDP keeps the instance; it only changes its class).

    Raises:
        HFModelError: it is another module (the provider was handed a model it did not build).
    """
    if not isinstance(model, HFCausalLM):
        raise HFModelError(
            f"the Hugging Face backend was handed a {type(model).__name__}, not the HFCausalLM its "
            "initialize_model_stage built"
        )
    return model
