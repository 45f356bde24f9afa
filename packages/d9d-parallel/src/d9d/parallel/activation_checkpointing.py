"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Non-reentrant `torch.utils.checkpoint`, applied by wrapping each chosen block's `forward` in place,
so parameter names and state-dict keys never change. Works with FSDP2, tensor, pipeline and expert
parallelism; apply it before `torch.compile` and before `parallelize_*` (as torchtitan does).
"""

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from d9d.parallel._wrap import wrap_forward
from d9d.parallel.config import ActivationCheckpointingConfig
from d9d.parallel.errors import ParallelizeError

__all__ = ["ActivationCheckpointingConfig", "apply_activation_checkpointing", "checkpointed_blocks"]


def checkpointed_blocks(num_blocks: int, config: ActivationCheckpointingConfig) -> list[int]:
    """Indices of the blocks `config` checkpoints, out of `num_blocks`."""
    if config.mode == "none":
        return []
    step = 1 if config.mode == "full" else config.every
    return list(range(0, num_blocks, step))


def apply_activation_checkpointing(
    modules: Iterable[nn.Module], config: ActivationCheckpointingConfig | None = None
) -> list[nn.Module]:
    """Checkpoint the blocks `config` selects (all of `modules` when `config` is None); idempotent.

    Returns the modules that are checkpointed now.
    """
    blocks: Sequence[nn.Module] = list(modules)
    if config is None:
        chosen = list(range(len(blocks)))
    elif isinstance(config, ActivationCheckpointingConfig):
        chosen = checkpointed_blocks(len(blocks), config)
    else:
        raise ParallelizeError(
            f"apply_activation_checkpointing: config must be an ActivationCheckpointingConfig, got {config!r}"
        )
    done = []
    for index in chosen:
        module = blocks[index]
        if not getattr(module, "_d9d_activation_checkpointed", False):
            wrap_forward(module, _checkpointed)
            module._d9d_activation_checkpointed = True  # type: ignore[assignment]
        done.append(module)
    if done:
        _compile_forward_side_effects_once()
    return done


def _compile_forward_side_effects_once() -> None:
    """Let torch.compile trace a checkpointed block whose forward records something on a module.

    A MoE layer keeps its load statistics of the last forward (`MoE.last_stats`); dynamo refuses that
    side effect inside a checkpointed region (the recompute in the backward would replay it) and ran
    the whole block eagerly. The recorded values are meant once per forward, so the recompute need
    not replay them: torch's switch for exactly that (where torch has it; a global of dynamo).
    """
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _checkpointed(inner: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(inner, module, *args, use_reentrant=False, **kwargs)
