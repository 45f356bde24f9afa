"""What a training step keeps on purpose, for `d9d.mesh.testing.StorageCensus`'s exclusions."""

from typing import Any

import torch
from torch import nn

from d9d.mesh.testing import StorageCensus

__all__ = ["StorageCensus", "training_state"]


def training_state(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Any]:
    """Parameters, their gradients, buffers and the optimizer's state."""
    params = list(module.parameters())
    kept: list[Any] = [*params, *(p.grad for p in params if p.grad is not None), *module.buffers()]
    if optimizer is not None:
        kept += [v for state in optimizer.state.values() for v in state.values()]
    return kept
