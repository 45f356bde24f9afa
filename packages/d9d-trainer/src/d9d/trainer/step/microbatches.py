"""The plain step: the microbatches one after another, gradients accumulated, one update."""

from collections.abc import Sequence
from typing import Any

import torch

from d9d.parallel import precision_autocast, set_gradient_accumulation
from d9d.parallel.expert import moe_regularization_loss
from d9d.trainer.providers.task import LossContext, metric_sums
from d9d.trainer.step.base import StepBase, StepOutput

__all__ = ["MicrobatchStep"]


class MicrobatchStep(StepBase):
    """Loss-weighted gradient accumulation over the step's microbatches.

    Each microbatch's summed loss is divided by the global batch's weight, so the accumulated (and
    data-parallel summed) gradient is exactly the single-device gradient of the global mean loss.
    Sharded FSDP2 units reduce-scatter every microbatch (no unsharded gradient outlives its block);
    only replicated units defer their all-reduce to the last microbatch. Each microbatch draws its
    randomness (dropout) from its own stream, keyed by its place in the global batch
    (`TrainingRandomness.seed_microbatch`). Each weight is cast to the compute dtype once for all the
    microbatches and their recomputes (`StepBase.weights_cast_once`).
    """

    def run(self, microbatches: Sequence[Any], step: int) -> StepOutput:
        """One optimizer step over `microbatches` (this rank's share of the global batch)."""
        model, settings = self.model, self.settings
        microbatches = self.local_part(microbatches)
        weight = self.global_weight(microbatches)
        scale = weight.to(torch.float32)
        self.float8_scales()
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # the summed loss, then the task's summed metrics: one vector, one all-reduce over dp
        sums = torch.zeros(1 + len(self.metric_names), dtype=torch.float64, device=settings.device)
        with self.weights_cast_once():  # the compute copies of the weights: one for all microbatches
            for i, batch in enumerate(microbatches):
                sums += self._microbatch(batch, i, len(microbatches), step, scale)
        set_gradient_accumulation(model, final=True)
        sums = self.dp_sum(sums)
        return self.finish(sums[0] / weight, weight, step, metrics=sums[1:])

    def _microbatch(self, batch: Any, i: int, count: int, step: int, scale: torch.Tensor) -> torch.Tensor:
        """Forward and backward of microbatch `i` of `count`; its summed loss and metrics (float64,
        detached)."""
        model, settings = self.model, self.settings
        if settings.randomness is not None:
            settings.randomness.seed_microbatch(step, i, count)
        with self.microbatch_range(i), settings.attention_kernels():
            set_gradient_accumulation(model, final=i == count - 1)
            with precision_autocast(settings.precision, settings.device):
                result = self.task.compute_loss(LossContext(model=model, batch=batch, device=settings.device))
            objective = result.loss_sum / scale
            regularization = moe_regularization_loss(self.moes)  # MoE balancing terms, when configured
            if regularization is not None:  # each microbatch's is its global batch's: their mean
                objective = objective + regularization / count
            objective.backward()
            self.add_expert_load()
        loss = result.loss_sum.detach().to(torch.float64).reshape(1)
        return torch.cat([loss, metric_sums(self.metric_names, result, settings.device)])
