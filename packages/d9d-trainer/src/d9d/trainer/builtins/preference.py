"""Preference optimization (`d9d.trainer:PreferenceTask`): DPO and its variants on prompt/chosen/rejected
pairs (`d9d.data.PreferenceDataset`), configured by the job's `preference:` section.

    providers: {dataset: d9d.trainer:PreferenceDatasetProvider, task: d9d.trainer:PreferenceTask}
    preference: {loss: sigmoid, beta: 0.1}

Each sequence's log-probability is the sum over its completion tokens of log p(token | everything
before it); a pair's scores compare the policy's with the reference's (the frozen starting weights):
`chosen reward = beta * (log p_policy(chosen) - log p_ref(chosen))`, the same for rejected.

The reference log-probabilities are computed once, in a forward-only pass over the training and eval
sets with the starting weights before the first step (with LoRA: the base model, adapters off), on
the job's own mesh; they are kept in every checkpoint (16 bytes a pair), so a resumed run reads them
back and never needs the starting weights again. No second model is held: the reference costs one
forward over the data, no memory, and works on every mesh the forward does (pipeline stages included).
"""

import math
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d9d.data import IGNORE_INDEX
from d9d.mesh import get_logger
from d9d.parallel import lora_disabled, set_head_reduction
from d9d.trainer.builtins.logprobs import token_logps
from d9d.trainer.errors import TrainingError
from d9d.trainer.providers.task import (
    LossContext,
    LossResult,
    PrepareRunContext,
    fused_loss_chunk_size,
    tensor_from_state,
    tensor_state,
)

__all__ = ["PreferenceConfig", "PreferenceTask", "preference_losses"]

_log = get_logger("d9d.trainer")

#: Keys of a packed batch that the model takes besides `input_ids`.
_PACKED_KEYS = ("position_ids", "document_ids")

#: What the target of a pair batch holds (the last stage's share of the batch under pipelining).
_TARGET_KEYS = ("labels", "sequence_ids", "pair_ids", "reference_logps")

#: The losses that compare with the reference policy (SimPO needs none).
_WITH_REFERENCE = ("sigmoid", "ipo")


class PreferenceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `preference:` section.

    Attributes:
        loss: `sigmoid` (DPO: -log σ(β·margin)), `ipo` (IPO: (margin per completion token − 1/(2β))²,
            length-normalized as TRL does), `simpo` (SimPO, reference-free: -log σ(β·(mean log-prob
            of chosen − of rejected) − gamma)), or `bradley_terry` (a reward model: -log σ(r_chosen −
            r_rejected) on the scores of a one-label head, `model.head: {kind: classification,
            num_labels: 1}`).
        beta: β, the strength of the implicit KL constraint (DPO, IPO) or the reward scale (SimPO).
        gamma: SimPO's target reward margin (unused by the others).
    """

    loss: Literal["sigmoid", "ipo", "simpo", "bradley_terry"] = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"preference.beta must be a positive number, got {self.beta}")
        if not math.isfinite(self.gamma):
            raise ValueError(f"preference.gamma must be a finite number, got {self.gamma}")


def preference_losses(
    config: PreferenceConfig,
    logps: torch.Tensor,
    reference: torch.Tensor | None,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and rewards of one microbatch.

    Args:
        config: the loss and its coefficients.
        logps: [pairs, 2] summed completion log-probabilities under the policy (chosen, rejected).
        reference: [pairs, 2] the same under the reference policy (None for SimPO).
        lengths: [pairs, 2] completion tokens of each sequence.

    Returns:
        ([pairs] losses, [pairs, 2] rewards of chosen and rejected).
    """
    beta = config.beta
    if config.loss == "simpo":
        mean = logps / lengths.clamp(min=1)
        rewards = beta * mean
        losses = -F.logsigmoid(beta * (mean[:, 0] - mean[:, 1]) - config.gamma)
        return losses, rewards.detach()
    assert reference is not None
    ratios = logps - reference.to(logps.dtype)  # log π/π_ref of chosen and rejected
    rewards = beta * ratios
    if config.loss == "sigmoid":
        losses = -F.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1]))
    else:  # ipo, per completion token
        per_token = ratios / lengths.clamp(min=1)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    return losses, rewards.detach()


class PreferenceTask:
    """Preference optimization over pair batches (`d9d.data.PreferenceDataset`'s layout).

    A microbatch holds `input_ids`/`labels`/`sequence_ids` [rows, seq] and `pair_ids` [pairs]: pair
    k's chosen completion is sequence 2k, its rejected one 2k+1 (packed rows add `position_ids` and
    `document_ids`). The loss is summed over the pairs, the weight is the pair count: the trainer's
    normalization makes it the mean over the global batch's pairs, as one process would compute it.
    Metrics (`metric_names`), each the mean over the global batch's pairs: `rewards/chosen`,
    `rewards/rejected`, `rewards/margins` (chosen − rejected), `rewards/accuracies` (the share of pairs
    whose chosen reward is above the rejected one), `logps/chosen`, `logps/rejected` (summed
    completion log-probabilities under the policy).
    """

    config_type = PreferenceConfig
    config_section = "preference"
    supports_context_parallel = False

    def __init__(self, config: PreferenceConfig | None = None) -> None:
        self.config = config or PreferenceConfig()
        self._tables: dict[str, torch.Tensor] = {}  # role → [pairs, 2] float64 reference log-probs
        self._recording: tuple[torch.Tensor, torch.Tensor] | None = None  # (table, filled) of a pass
        # the models whose fused heads return per-token losses (weakly: a model's id can be reused)
        self._per_token_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with the reference policy (all but SimPO and a reward model)."""
        return self.config.loss in _WITH_REFERENCE

    @property
    def reward_model(self) -> bool:
        """The model scores sequences with a head (`bradley_terry`), not by its log-probabilities."""
        return self.config.loss == "bradley_terry"

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The rewards of chosen and rejected, their margin and the pairwise accuracy; the policy's
        log-probabilities too, except for a reward model (whose rewards are its scores)."""
        rewards = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
        return rewards if self.reward_model else (*rewards, "logps/chosen", "logps/rejected")

    # ------------------------------------------------------------------ the step

    def batch_weight(self, batch: Any) -> torch.Tensor:
        """The pairs of the microbatch."""
        return torch.tensor(batch["pair_ids"].numel(), dtype=torch.float64)

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward the rows and score every pair (`pipeline_loss`)."""
        batch, device, model = context.batch, context.device, context.model
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        packed = {key: batch[key].to(device, non_blocking=True) for key in _PACKED_KEYS if key in batch}
        if self.reward_model:
            return self.pipeline_loss(model(input_ids, **packed), self._target(batch))
        if fused_loss_chunk_size(model) is not None:  # the head's per-token losses: no [tokens, vocab] logits
            self._per_token(model)
            packed["labels"] = batch["labels"].to(device, non_blocking=True)
        return self.pipeline_loss(model(input_ids, **packed), self._target(batch))

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Under pipeline parallelism: the first stage gets `input_ids`; the loss, the pair target."""
        return batch["input_ids"], self._target(batch)

    def pipeline_kwargs(self, batch: Any, stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """Every stage's attention inputs of a packed batch (positions and documents), and the labels
        when this rank's last stage computes its per-token losses fused."""
        kwargs = {key: batch[key] for key in _PACKED_KEYS if key in batch}
        if self.reward_model:  # the head's last stage finds each sequence's last token from the ids
            kwargs["tokens"] = batch["input_ids"]
        elif any(fused_loss_chunk_size(stage) is not None for stage in stages):
            for stage in stages:
                self._per_token(stage)
            kwargs["labels"] = batch["labels"]
        return kwargs

    def pipeline_loss(self, output: torch.Tensor, target: Mapping[str, torch.Tensor]) -> LossResult:
        """The summed loss of the microbatch's pairs and their summed metrics (or, during the reference
        pass, their log-probabilities recorded and a zero loss). `output`: the model's logits, or a
        fused head's per-token losses (`set_head_reduction(model, "none")`, set by `prepare_run`)."""
        pairs = target["pair_ids"].numel()
        if self.reward_model:
            return self._reward_loss(output, pairs)
        device = output.device
        labels = target["labels"].to(device)
        sequences = target["sequence_ids"].to(device)
        logps, lengths = sequence_logps(token_logps(output, labels), labels, sequences, 2 * pairs)
        logps, lengths = logps.view(pairs, 2), lengths.view(pairs, 2)
        if self._recording is not None:
            table, filled = self._recording
            ids = target["pair_ids"].to(table.device)
            table.index_copy_(0, ids, logps.detach().to(table))
            filled.index_fill_(0, ids, 1.0)
            zero = logps.sum() * 0
            return LossResult(
                loss_sum=zero, weight=float(pairs), metrics=dict.fromkeys(self.metric_names, zero)
            )
        reference = self._reference(target, pairs) if self.needs_reference else None
        losses, rewards = preference_losses(self.config, logps, reference, lengths)
        margins = rewards[:, 0] - rewards[:, 1]
        detached = logps.detach()
        metrics = {
            "rewards/chosen": rewards[:, 0].sum(),
            "rewards/rejected": rewards[:, 1].sum(),
            "rewards/margins": margins.sum(),
            "rewards/accuracies": (margins > 0).to(torch.float64).sum(),
            "logps/chosen": detached[:, 0].sum(),
            "logps/rejected": detached[:, 1].sum(),
        }
        return LossResult(loss_sum=losses.sum(), weight=float(pairs), metrics=metrics)

    def _per_token(self, model: nn.Module) -> None:
        """Make `model`'s fused heads return per-token losses, once per model (`prepare_run` does it for
        the run's model; a model it never saw, e.g. the planner's, here)."""
        if model not in self._per_token_models:
            set_head_reduction(model, "none")
            self._per_token_models.add(model)

    def planning_batch(self, microbatch_size: int, seq_len: int, packed: bool) -> dict[str, torch.Tensor]:
        """A meta microbatch as `PreferenceDataset` gives one (`ShapesBatch`): two rows per pair, or
        (packed) a row of pairs, counted here as one pair a row."""
        rows, pairs = (microbatch_size, microbatch_size) if packed else (2 * microbatch_size, microbatch_size)
        meta = {"dtype": torch.long, "device": "meta"}
        batch = {key: torch.zeros(rows, seq_len, **meta) for key in ("input_ids", "labels", "sequence_ids")}
        batch["pair_ids"] = torch.zeros(pairs, **meta)
        if packed:
            batch |= {key: torch.zeros(rows, seq_len, **meta) for key in _PACKED_KEYS}
        if self.needs_reference:
            batch["reference_logps"] = torch.zeros(pairs, 2, dtype=torch.float64, device="meta")
        return batch

    def _reward_loss(self, scores: torch.Tensor, pairs: int) -> LossResult:
        """Bradley-Terry: -log σ(r_chosen − r_rejected) on the head's [2·pairs, 1] scores (pair k's
        chosen sequence is 2k, its rejected 2k+1: a row each, or a packed document each)."""
        if scores.ndim != 2 or tuple(scores.shape) != (2 * pairs, 1):
            raise TrainingError(
                f"preference.loss: bradley_terry needs one score per sequence ([{2 * pairs}, 1] for {pairs} pairs); "
                f"the model returned shape {tuple(scores.shape)}: give it a one-label score head "
                "(model.head: {kind: classification, num_labels: 1})"
            )
        rewards = scores.float().view(pairs, 2)
        losses = -F.logsigmoid(rewards[:, 0] - rewards[:, 1])
        detached = rewards.detach()
        margins = detached[:, 0] - detached[:, 1]
        metrics = {
            "rewards/chosen": detached[:, 0].sum(),
            "rewards/rejected": detached[:, 1].sum(),
            "rewards/margins": margins.sum(),
            "rewards/accuracies": (margins > 0).to(torch.float64).sum(),
        }
        return LossResult(loss_sum=losses.sum(), weight=float(pairs), metrics=metrics)

    def _target(self, batch: Any) -> dict[str, torch.Tensor]:
        return {key: batch[key] for key in _TARGET_KEYS if key in batch}

    def _reference(self, target: Mapping[str, torch.Tensor], pairs: int) -> torch.Tensor:
        reference = target.get("reference_logps")
        if reference is None:
            raise TrainingError(
                "a preference batch has no reference log-probabilities: the dataset must be a "
                "d9d.data.PreferenceDataset (providers.dataset: d9d.trainer:PreferenceDatasetProvider), whose "
                "batches carry them once the task's reference pass ran; or use preference.loss: simpo"
            )
        return reference.reshape(pairs, 2)

    # ------------------------------------------------------------------ the reference pass

    def prepare_run(self, context: PrepareRunContext) -> None:
        """Give every dataset its reference log-probabilities: from the checkpoint the run resumed from,
        or computed now with the starting weights (adapters off under LoRA). A fused head returns its
        per-token losses from now on (`set_head_reduction`)."""
        self._per_token(context.model)
        if not self.needs_reference:
            return
        for role, dataset in context.datasets.items():
            if role not in self._tables:
                if context.restored:
                    raise TrainingError(
                        f"the checkpoint this run resumed from holds no reference log-probabilities of its {role} "
                        "set (it was saved by another task); start a new run (another trainer.run.name) for "
                        "preference optimization"
                    )
                self._tables[role] = self._compute(context, role, dataset)
            _attach(dataset, self._tables[role], role)

    def _compute(self, context: PrepareRunContext, role: str, dataset: Any) -> torch.Tensor:
        pairs = _num_pairs(dataset, role)
        device = context.context.device
        table = torch.zeros(pairs, 2, dtype=torch.float64, device=device)
        filled = torch.zeros(pairs, dtype=torch.float64, device=device)
        self._recording = (table, filled)
        try:
            with lora_disabled(context.model):
                context.forward_only(role)
        finally:
            self._recording = None
        if dist.is_initialized() and dist.get_world_size() > 1:  # each pair on its dp rank's last stage
            dist.all_reduce(table)
            dist.all_reduce(filled)
        if bool((filled == 0).any()):
            missing = int((filled == 0).sum())
            raise TrainingError(f"the reference pass over the {role} set left {missing} pairs unscored")
        table = (table / filled[:, None]).cpu()  # identical copies (tp ranks) divide out exactly in fp64
        _log.info("reference log-probs", set=role, pairs=pairs, mean_chosen=round(float(table[:, 0].mean()), 4),
                  mean_rejected=round(float(table[:, 1].mean()), 4))  # fmt: skip
        return table

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """The reference log-probabilities ([pairs, 2] float64 per set), saved in every checkpoint."""
        return {"reference_logps": {role: tensor_state(table) for role, table in self._tables.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the reference log-probabilities of a checkpoint (`state_dict`)."""
        saved = state.get("reference_logps") or {}
        self._tables = {role: tensor_from_state(entry) for role, entry in saved.items()}


def sequence_logps(
    token_logps: torch.Tensor, labels: torch.Tensor, sequences: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the labels of each sequence (float32) and its labelled tokens.

    Args:
        token_logps: each label's log-probability, flat (`token_logps`).
        labels: [rows, seq] the next token at each position (IGNORE_INDEX: none).
        sequences: [rows, seq] the sequence each labelled position belongs to (-1: none).
        count: sequences in the microbatch.

    Returns:
        ([count] log-probabilities, [count] labelled tokens).
    """
    device = token_logps.device
    index = sequences.reshape(-1)
    counted = (index >= 0) & (labels.reshape(-1) != IGNORE_INDEX)
    index = torch.where(counted, index, torch.zeros_like(index))
    logps = torch.zeros(count, dtype=token_logps.dtype, device=device)
    logps = logps.index_add(0, index, torch.where(counted, token_logps, torch.zeros_like(token_logps)))
    lengths = torch.zeros(count, dtype=token_logps.dtype, device=device)
    lengths = lengths.index_add(0, index, counted.to(token_logps.dtype))
    return logps, lengths


def _num_pairs(dataset: Any, role: str) -> int:
    pairs = getattr(dataset, "num_pairs", None)
    if not isinstance(pairs, int):
        raise TrainingError(
            f"the {role} set ({type(dataset).__name__}) does not say how many pairs it holds (num_pairs); "
            "preference optimization needs a d9d.data.PreferenceDataset (d9d.trainer:PreferenceDatasetProvider)"
        )
    return pairs


def _attach(dataset: Any, table: torch.Tensor, role: str) -> None:
    if table.shape[0] != _num_pairs(dataset, role):
        raise TrainingError(
            f"the checkpoint's reference log-probabilities cover {table.shape[0]} pairs of the {role} set, which "
            f"now holds {_num_pairs(dataset, role)}: the data changed since the run started; restore it, or start "
            "a new run (another trainer.run.name)"
        )
    dataset.reference_logps = table
