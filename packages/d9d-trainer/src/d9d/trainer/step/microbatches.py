"""The plain step: the microbatches one after another, gradients accumulated, one update."""

from collections.abc import Sequence
from typing import Any

import torch

from d9d.parallel import precision_autocast, set_gradient_accumulation
from d9d.parallel.expert import moe_regularization_loss
from d9d.trainer.providers.task import LossContext
from d9d.trainer.step.base import StepBase, StepOutput

__all__ = ["MicrobatchStep"]


class MicrobatchStep(StepBase):
    """Loss-weighted gradient accumulation over the step's microbatches.

    Each microbatch's summed loss is divided by the global batch's weight, so the accumulated (and
    data-parallel summed) gradient is exactly the single-device gradient of the global mean loss.
    Sharded FSDP2 units reduce-scatter every microbatch (no unsharded gradient outlives its block);
    only replicated units defer their all-reduce to the last microbatch. Each microbatch draws its
    randomness (dropout) from its own stream, keyed by its place in the global batch
    (`TrainingRandomness.seed_microbatch`).
    """

    def run(self, microbatches: Sequence[Any], step: int) -> StepOutput:
        """One optimizer step over `microbatches` (this rank's share of the global batch)."""
        model, settings = self.model, self.settings
        microbatches = self.local_part(microbatches)
        weight = self.global_weight(microbatches)
        scale = weight.to(torch.float32)
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=settings.device)
        last = len(microbatches) - 1
        randomness = settings.randomness
        for i, batch in enumerate(microbatches):
            if randomness is not None:
                randomness.seed_microbatch(step, i, len(microbatches))
            with self.microbatch_range(i), settings.attention_kernels():
                set_gradient_accumulation(model, final=i == last)
                with precision_autocast(settings.precision, settings.device):
                    context = LossContext(model=model, batch=batch, device=settings.device)
                    result = self.task.compute_loss(context)
                objective = result.loss_sum / scale
                regularization = moe_regularization_loss(self.moes)  # MoE balancing terms, when configured
                if regularization is not None:  # each microbatch's is its global batch's: their mean
                    objective = objective + regularization / len(microbatches)
                objective.backward()
                self.add_expert_load()
                loss_sum += result.loss_sum.detach().to(torch.float64)
        set_gradient_accumulation(model, final=True)
        loss = self.dp_sum(loss_sum) / weight
        return self.finish(loss, weight, step)
