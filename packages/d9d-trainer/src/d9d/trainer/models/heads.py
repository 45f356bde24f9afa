"""Heads on the reference decoder: sequence classification (a reward model is one label) and
embeddings, as `model.head` asks (`ClassificationHead`, `EmbeddingHead`).

`ReferenceWithHead` keeps Hugging Face's names (`model.*` and, for classification, `score.weight`, as
`Qwen3ForSequenceClassification` / `LlamaForSequenceClassification`), so a folder saved by
`AutoModelForSequenceClassification` loads as it is and an export loads back there. The pooling
(`last_token_index`, `pool`) is plain tensor code the Hugging Face backend shares.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from d9d.mesh import D9dError
from d9d.trainer.models.config import ClassificationHead, EmbeddingHead, ReferenceModelConfig
from d9d.trainer.models.model import ReferenceForCausalLM, ReferenceModel

__all__ = [
    "HeadExportError",
    "ReferenceWithHead",
    "build_reference_model",
    "check_head_export",
    "head_hf_fields",
    "last_token_index",
    "pool",
    "sequence_ids",
]


class HeadExportError(D9dError, ValueError):
    """A model is exported as a sequence classifier (or reward model) but holds no score head."""


def sequence_ids(tokens: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Which sequence each token [batch, seq] belongs to, numbered 0.. in row-major order: a row, or with
    packed rows (`document_ids`) each run of one document id in a row."""
    batch, seq = tokens.shape
    if document_ids is None:
        return torch.arange(batch, device=tokens.device)[:, None].expand(batch, seq)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts.flatten().cumsum(0).view(batch, seq) - 1


def _count(tokens: torch.Tensor, ids: torch.Tensor, document_ids: torch.Tensor | None) -> int:
    """How many sequences `sequence_ids` numbered: the rows (no device read, so the forward also runs
    on the meta device), or with packed rows one host read of the documents' count."""
    return tokens.shape[0] if document_ids is None else int(ids[-1]) + 1


def _real_tokens(
    tokens: torch.Tensor, pad_token_id: int | None, document_ids: torch.Tensor | None
) -> torch.Tensor:
    """[batch, seq] True where a token is not padding (by `pad_token_id`, and a packed row's padding
    document, id -1)."""
    real = torch.ones_like(tokens, dtype=torch.bool) if pad_token_id is None else tokens != pad_token_id
    if document_ids is not None:
        real = real & (document_ids >= 0)
    return real


def last_token_index(
    tokens: torch.Tensor, pad_token_id: int | None, document_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat index (row * seq + position) of each sequence's rightmost non-padding token, as
    transformers' `*ForSequenceClassification` picks it (a sequence of padding only: its first token).

    Args:
        tokens: [batch, seq] token ids.
        pad_token_id: the padding token; None: every token counts (the row's last).
        document_ids: [batch, seq] packed rows: one index per document, in row-major order; the
            padding document (-1) gives none.
    """
    ids = sequence_ids(tokens, document_ids).flatten()
    count = _count(tokens, ids, document_ids)
    flat = torch.arange(tokens.numel(), device=tokens.device)
    real = _real_tokens(tokens, pad_token_id, document_ids).flatten()
    first = torch.full((count,), tokens.numel(), device=tokens.device).scatter_reduce(0, ids, flat, "amin")
    last = torch.full((count,), -1, device=tokens.device).scatter_reduce(
        0, ids, torch.where(real, flat, -1), "amax"
    )
    picked = torch.where(last >= 0, last, first)
    if document_ids is None:
        return picked
    keep = document_ids.flatten()[first] >= 0  # the padding document is no sequence
    return picked[keep]


def pool(
    hidden_states: torch.Tensor,
    tokens: torch.Tensor,
    *,
    pooling: str,
    pad_token_id: int | None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[batch, seq, hidden] → [sequences, hidden]: the last non-padding token's state ("last") or the
    mean over the non-padding tokens ("mean"), per row or, with `document_ids`, per packed document."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    if pooling == "last":
        return flat[last_token_index(tokens, pad_token_id, document_ids)]
    ids = sequence_ids(tokens, document_ids).flatten()
    real = _real_tokens(tokens, pad_token_id, document_ids).flatten()
    count = _count(tokens, ids, document_ids)
    weights = real.to(flat.dtype)[:, None]
    sums = flat.new_zeros(count, flat.shape[-1]).index_add(0, ids, flat * weights)
    tokens_per = flat.new_zeros(count).index_add(0, ids, weights[:, 0])
    means = sums / tokens_per.clamp(min=1)[:, None]
    if document_ids is None:
        return means
    starts = torch.full((count,), tokens.numel(), device=tokens.device).scatter_reduce(
        0, ids, torch.arange(tokens.numel(), device=tokens.device), "amin"
    )
    return means[document_ids.flatten()[starts] >= 0]


class ReferenceWithHead(ReferenceForCausalLM):
    """The reference decoder with `config.head` instead of the LM head: [sequences, num_labels] scores
    (`ClassificationHead`, `score`) or [sequences, hidden] pooled embeddings (`EmbeddingHead`, no
    parameters of its own), one per row (or per packed document).

    The causal LM's lifecycle is reused as it is (meta build, `init_weights`, `initialize_module`:
    the score head draws normal(0, initializer_range) like every linear), with `lm_head` None. On a
    pipeline stage without the final norm (`trim_to_stage`) `score` is None too and the forward
    returns the hidden states. Under tensor parallelism the head is replicated: the sequence-parallel
    hidden states are gathered before pooling.
    """

    def __init__(self, config: ReferenceModelConfig) -> None:
        if config.head is None:
            raise ValueError("ReferenceWithHead needs model.head (kind: classification or embedding)")
        nn.Module.__init__(self)
        self.config = config
        self.model = ReferenceModel(config)
        self.lm_head = None
        self.score: nn.Linear | None = None
        if isinstance(config.head, ClassificationHead):
            self.score = nn.Linear(config.hidden_size, config.head.num_labels, bias=False)
        if not next(self.parameters()).is_meta:
            self.init_weights()

    def tied_parameters(self) -> list[tuple[str, ...]]:
        """None: with no LM head, nothing shares the embedding table."""
        return []

    @property
    def is_last_stage(self) -> bool:
        """Whether this model (stage) ends in the head (a pipeline stage without the final norm does not)."""
        return self.model.norm is not None

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids` [batch, seq] → scores [sequences, num_labels] or embeddings [sequences, hidden]
        (float32 when `config.fp32_logits`); a stage without the head returns its hidden states.

        Args:
            position_ids, document_ids: as in `ReferenceModel.forward`; with `document_ids` every
                packed document is a sequence (the padding document none).
            tokens: the batch's token ids, for finding the padding when `input_ids` are hidden states
                (the last pipeline stage); default `input_ids`.
        """
        hidden_states = self.model(input_ids, position_ids, document_ids)
        if not self.is_last_stage:
            return hidden_states
        if isinstance(hidden_states, DTensor):  # sequence-parallel (tp): the head sees the whole sequence
            hidden_states = hidden_states.redistribute(placements=[Replicate()]).to_local()
        tokens = tokens if tokens is not None else input_ids
        head = self.config.head
        if isinstance(head, EmbeddingHead):
            out = pool(hidden_states, tokens, pooling=head.pooling, pad_token_id=head.pad_token_id,
                       document_ids=document_ids)  # fmt: skip
            out = F.normalize(out.float(), dim=-1).to(out.dtype) if head.normalize else out
        else:
            assert isinstance(head, ClassificationHead) and self.score is not None
            picked = pool(hidden_states, tokens, pooling="last", pad_token_id=head.pad_token_id,
                          document_ids=document_ids)  # fmt: skip
            out = self.score(picked)
        return out.float() if self.config.fp32_logits else out


def build_reference_model(config: ReferenceModelConfig) -> Any:
    """The reference model `config` describes: `ReferenceForCausalLM`, or `ReferenceWithHead` when
    `config.head` is set."""
    return ReferenceForCausalLM(config) if config.head is None else ReferenceWithHead(config)


def head_hf_fields(head: Any, causal_architecture: str) -> dict[str, Any]:
    """The config.json keys of a head (none for a causal LM): a classifier's
    `<Arch>ForSequenceClassification`, `num_labels`, `id2label`/`label2id` and `pad_token_id`, which
    `AutoModelForSequenceClassification` reads; an embedding model's base class (`<Arch>Model`)."""
    base = causal_architecture.removesuffix("ForCausalLM")
    if isinstance(head, EmbeddingHead):
        return {"architectures": [f"{base}Model"], "pad_token_id": head.pad_token_id}
    if not isinstance(head, ClassificationHead):
        return {}
    names = head.id2label or {i: f"LABEL_{i}" for i in range(head.num_labels)}
    return {
        "architectures": [f"{base}ForSequenceClassification"],
        "num_labels": head.num_labels,
        "id2label": {str(i): name for i, name in sorted(names.items())},
        "label2id": {name: i for i, name in sorted(names.items())},
        "pad_token_id": head.pad_token_id,
    }


def check_head_export(model: nn.Module, config: ReferenceModelConfig, *, whole: bool = True) -> None:
    """Refuse to export a classification (reward) model without its score head.

    Args:
        whole: `model` is the whole model (not a pipeline stage, which may hold no head).

    Raises:
        HeadExportError: `config.head` is a classification head and `model` has no `score`.
    """
    if not isinstance(config.head, ClassificationHead) or not whole:
        return
    if not isinstance(model, ReferenceWithHead) or model.score is None:
        raise HeadExportError(
            f"model.head asks for a sequence classifier ({config.head.num_labels} labels) but the exported "
            f"{type(model).__name__} has no score head (score.weight); build it with the same model.head "
            "(d9d.trainer.models.build_reference_model) before exporting"
        )
