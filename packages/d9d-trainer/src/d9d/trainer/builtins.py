"""Built-in providers: causal-LM task, AdamW/SGD, warmup + cosine/linear/constant LR, AutoData."""

import math
from collections.abc import Iterable
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from d9d.data import (
    IGNORE_INDEX,
    AutoDataConfig,
    AutoDataProvider,
    DataProvider,
    SFTDataset,
    microbatches_per_rank,
)
from d9d.mesh import MeshConfig, get_logger
from d9d.trainer.config import LRSchedulerConfig, OptimizerConfig
from d9d.trainer.errors import TrainingError
from d9d.trainer.providers import (
    Batching,
    BuildDataProviderContext,
    LossContext,
    LossResult,
    OptimizerStates,
)

_log = get_logger("d9d.trainer")

__all__ = [
    "AutoDataProviderFactory",
    "BuiltinLRSchedulerProvider",
    "BuiltinOptimizerProvider",
    "CausalLMTask",
    "lr_multiplier",
    "optimizer_kernels",
]


#: Keys of a packed batch that the model takes besides `input_ids` (positions restart per document).
_PACKED_KEYS = ("position_ids", "document_ids")


class CausalLMTask:
    """Next-token prediction: `batch` is a mapping with `input_ids` and `labels` (already shifted).

    The loss is the summed token cross-entropy; the weight is the number of labels that are not
    `IGNORE_INDEX`, so the trainer's normalization makes it the mean over the global batch's tokens.
    """

    config_type = None

    def __init__(self, config: Any = None) -> None:
        del config

    def batch_weight(self, batch: Any) -> torch.Tensor:
        """Tokens that carry a label in this microbatch (a tensor: reading it would sync the host)."""
        return (batch["labels"] != IGNORE_INDEX).sum()

    def compute_loss(self, context: LossContext) -> LossResult:
        """Forward `input_ids` and sum the cross-entropy over every labelled token.

        Packed documents (a batch with `position_ids` and `document_ids`, e.g. d9d.data's
        `document_masking` or a packed `SFTDataset`) pass them to the model as keyword arguments, so
        attention stays within each document and positions restart per document.
        """
        batch = context.batch
        input_ids = batch["input_ids"].to(context.device, non_blocking=True)
        labels = batch["labels"].to(context.device, non_blocking=True)
        packed = {
            key: batch[key].to(context.device, non_blocking=True) for key in _PACKED_KEYS if key in batch
        }
        return self.pipeline_loss(context.model(input_ids, **packed), labels)

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Under pipeline parallelism: the first stage gets `input_ids`, the loss gets `labels`.

        Raises:
            TrainingError: the batch holds packed documents (`document_ids`), which the pipeline's
                stages do not receive yet.
        """
        if "document_ids" in batch:
            raise TrainingError(
                "packed documents (document_ids) with mesh.pipeline_parallel > 1 are not supported yet: "
                "the stages would attend across documents; turn off the dataset's document masking or "
                "set mesh.pipeline_parallel: 1"
            )
        return batch["input_ids"], batch["labels"]

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> LossResult:
        """Summed cross-entropy of `logits` against `labels` (labels equal to IGNORE_INDEX skipped)."""
        labels = labels.to(logits.device)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return LossResult(loss_sum=loss, weight=(labels != IGNORE_INDEX).sum())


class BuiltinOptimizerProvider:
    """AdamW or SGD from the `optimizer:` section; no weight decay on 1-D parameters (norms, biases)."""

    config_type = OptimizerConfig

    def __init__(self, config: OptimizerConfig) -> None:
        self._config = config

    def optimizer_states(self) -> OptimizerStates:
        """AdamW keeps two moments per parameter, SGD one momentum buffer (none without momentum),
        in `optimizer.state_dtype`."""
        dtype = torch.bfloat16 if self._config.state_dtype == "bfloat16" else None
        if self._config.name == "adamw":
            return OptimizerStates(2, "AdamW: exp_avg + exp_avg_sq", dtype)
        if self._config.momentum:
            return OptimizerStates(1, "SGD with momentum: 1 buffer", dtype)
        return OptimizerStates(0, "SGD without momentum: no state", dtype)

    def build_optimizer(self, named_parameters: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        """Two parameter groups: decayed (matrices, embeddings) and not decayed (vectors).

        torch's AdamW / SGD, or with `optimizer.state_dtype: bfloat16` d9d.parallel's
        `StateDtypeAdamW` / `StateDtypeSGD` (the same update, the states kept in bfloat16).
        """
        decay, no_decay = [], []
        for _, param in named_parameters:
            if param.requires_grad:
                (decay if param.ndim >= 2 else no_decay).append(param)
        groups = [
            {"params": decay, "weight_decay": self._config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        params = [p for g in groups for p in g["params"]]
        c = self._config
        kernels = optimizer_kernels(c.implementation, params)
        if c.state_dtype == "bfloat16":
            from d9d.parallel import StateDtypeAdamW, StateDtypeSGD  # DTensor's import: only when used

            if c.name == "adamw":
                return StateDtypeAdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **kernels)
            return StateDtypeSGD(groups, lr=c.lr, momentum=c.momentum, **kernels)
        if c.name == "adamw":
            return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **kernels)
        return torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum, **kernels)


def optimizer_kernels(implementation: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim keyword arguments (`fused` / `foreach`) for `optimizer.implementation`.

    `auto` takes fused kernels when every parameter is on CUDA, else foreach; foreach and fused
    kernels refuse a mix of DTensors and plain tensors, where `auto` falls back to the for-loop.

    Raises:
        ConfigError: `fused` or `foreach` was asked for parameters that cannot use it.
    """
    from d9d.trainer.job.load import ConfigError

    kinds = {type(p.data).__name__ == "DTensor" for p in params}
    mixed = len(kinds) > 1
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    if implementation == "auto":
        if mixed:
            return {"foreach": False}
        return {"fused": True} if on_cuda else {"foreach": True}
    if implementation in ("fused", "foreach") and mixed:
        raise ConfigError(
            f"optimizer.implementation: {implementation} needs every parameter to be a DTensor or every "
            "one a plain tensor, but this model mixes both (a parallelism applied to part of it); "
            "use optimizer.implementation: auto or for_loop"
        )
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    return {"foreach": False}


def lr_multiplier(
    step: int,
    *,
    name: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    decay_ratio: float = 0.1,
) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Linear warmup from 1/(warmup+1) to 1 over `warmup_steps`, then `constant`, or decay to
    `min_lr_ratio` at the last step along a cosine or a line; `wsd` stays at 1 until the last
    `decay_ratio × total_steps` steps, which decay linearly to `min_lr_ratio`.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    if name == "wsd":
        decay = max(1, round(decay_ratio * total_steps))
        start = max(warmup_steps, total_steps - decay)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / max(1, total_steps - start))
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if name == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class BuiltinLRSchedulerProvider:
    """Warmup then cosine, linear or constant, from the `lr_scheduler:` section."""

    config_type = LRSchedulerConfig

    def __init__(self, config: LRSchedulerConfig) -> None:
        self._config = config

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """A LambdaLR over `lr_multiplier`; its state is the step count, so it resumes exactly."""
        c = self._config
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_multiplier(
                step,
                name=c.name,
                warmup_steps=c.warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=c.min_lr_ratio,
                decay_ratio=c.decay_ratio,
            ),
        )


class AutoDataProviderFactory:
    """Builds `d9d.data.AutoDataProvider` over the dataset provider's dataset (`data:` section)."""

    config_type = AutoDataConfig

    def __init__(self, config: AutoDataConfig) -> None:
        self._config = config

    def batching(self, mesh: MeshConfig) -> Batching:
        """`global_batch_size` over dp ranks × microbatches of `microbatch_size` (checked to divide).

        Raises:
            BatchSizeError: the global batch does not split into dp × microbatch_size.
        """
        c = self._config
        n = microbatches_per_rank(c.global_batch_size, c.microbatch_size, mesh.data_parallel)
        return Batching(
            global_batch_size=c.global_batch_size,
            microbatch_size=c.microbatch_size,
            microbatches_per_step=n,
            data_parallel=mesh.data_parallel,
        )

    def build_data_provider(self, context: BuildDataProviderContext) -> DataProvider[Any]:
        """A fixed-global-batch provider sharded over the mesh's data-parallel ranks."""
        if context.dataset is None:
            raise ValueError("providers.dataset is required with the built-in AutoDataProvider")
        _log_dataset(context.dataset.dataset, context.context.is_main_process)
        return AutoDataProvider(
            self._config,
            context.dataset.dataset,
            context.dataset.collate_fn,
            context=context.context,
            pipeline_stages=context.pipeline_stages,
        )


def _log_dataset(dataset: Any, main_process: bool) -> None:
    """One line on rank 0 for an `SFTDataset`, which reports what building it did (`SFTDataset.stats`):
    records kept, truncated and dropped, and how full its (packed) rows are."""
    if not main_process or not isinstance(dataset, SFTDataset):
        return
    _log.info(
        "sft data",
        rows=len(dataset),
        packing_efficiency=round(dataset.packing_efficiency, 4),  # real tokens / token slots
        **msgspec.structs.asdict(dataset.stats),
    )
