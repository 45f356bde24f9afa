"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

Non-reentrant `torch.utils.checkpoint`, applied by wrapping each chosen block's `forward` in place,
so parameter names and state-dict keys never change. Works with FSDP2, tensor, pipeline and expert
parallelism; apply it before `torch.compile` and before `parallelize_*` (as torchtitan does).

`full` and `selective` recompute a whole block: its forward runs twice. `op` checkpoints every block
with a per-op policy (`op_checkpoint_policy`, torch's selective checkpointing): the outputs of the
matmuls, the attention kernels and the functional collectives are kept, the cheap ops between them
(norms, activations, elementwise, RoPE) recomputed, so backward repeats no matmul and no collective.
Every matmul output is kept (not every other one, torchtitan's further halving): the saved bytes are
then a fixed sum of output shapes that `d9d plan` counts exactly.
"""

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from d9d.parallel._wrap import wrap_forward
from d9d.parallel.config import ActivationCheckpointingConfig
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "ActivationCheckpointingConfig",
    "apply_activation_checkpointing",
    "checkpointed_blocks",
    "op_checkpoint_policy",
]

#: aten ops whose outputs `op` keeps: the matmuls (dense, batched, float8, MoE's grouped ones) and the
#: fused attention kernels of every backend (their CPU one included).
_SAVED_ATEN = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_grouped_mm",
    "_scaled_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
#: Higher-order ops kept likewise (FlexAttention, the document masks' kernel on CUDA).
_SAVED_HIGHER_ORDER = ("flex_attention",)
#: Functional collectives (tensor parallelism's gathers and reductions, expert parallelism's
#: all-to-all): kept, so backward does not repeat them.
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd")


def checkpointed_blocks(num_blocks: int, config: ActivationCheckpointingConfig) -> list[int]:
    """Indices of the blocks `config` checkpoints, out of `num_blocks`."""
    if config.mode == "none":
        return []
    step = config.every if config.mode == "selective" else 1
    return list(range(0, num_blocks, step))


def op_checkpoint_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy of `mode: op`: keep what matmuls, attention and collectives return, recompute the rest.

    A policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if _kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _kept(func: Any) -> bool:
    packet = getattr(func, "overloadpacket", None)
    if packet is None:  # a higher-order op
        return isinstance(func, torch._ops.HigherOrderOperator) and func.name() in _SAVED_HIGHER_ORDER
    return packet in _saved_packets() or func.namespace in _COLLECTIVES


@functools.cache
def _saved_packets() -> frozenset[Any]:
    """The packets of `_SAVED_ATEN` this torch has."""
    return frozenset(getattr(torch.ops.aten, name) for name in _SAVED_ATEN if hasattr(torch.ops.aten, name))


def apply_activation_checkpointing(
    modules: Iterable[nn.Module], config: ActivationCheckpointingConfig | None = None
) -> list[nn.Module]:
    """Checkpoint the blocks `config` selects (all of `modules` when `config` is None); idempotent.

    Returns the modules that are checkpointed now.

    Raises:
        ParallelizeError: `config` is not a config, or a block is already checkpointed the other way
            (whole-block vs `op`).
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
    kind = "op" if config is not None and config.mode == "op" else "block"
    done = []
    for index in chosen:
        module = blocks[index]
        if not getattr(module, "_d9d_activation_checkpointed", False):
            wrap_forward(module, _op_checkpointed if kind == "op" else _checkpointed)
            module._d9d_activation_checkpointed = True  # type: ignore[assignment]
            module._d9d_checkpoint_kind = kind  # type: ignore[assignment]
        elif getattr(module, "_d9d_checkpoint_kind", "block") != kind:
            raise ParallelizeError(
                f"apply_activation_checkpointing: block {index} is already checkpointed "
                f"{'per op' if kind == 'block' else 'whole'}; checkpoint a block one way only "
                "(build the model again to change trainer.activation_checkpointing.mode)"
            )
        done.append(module)
    if done:
        _compile_forward_side_effects_once()
    if done and kind == "op":
        _prepare_op_checkpointing()
    return done


#: `checkpoint`'s keywords for `op`, made once by `_prepare_op_checkpointing` before any block runs:
#: made inside a compiled forward, dynamo would break the graph on their signature check.
_OP_OPTIONS: dict[str, Any] = {}


def _prepare_op_checkpointing() -> None:
    # imported here: the compat module imports torch's pipelining (seconds), which checkpointing needs not
    from d9d.parallel._torch_compat import (
        ignore_profiler_ranges_in_selective_checkpoints,
        selective_checkpoint_options,
    )

    if not _OP_OPTIONS:
        _OP_OPTIONS.update(selective_checkpoint_options(op_checkpoint_policy))
    ignore_profiler_ranges_in_selective_checkpoints()


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


def _op_checkpointed(inner: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(inner, module, *args, use_reentrant=False, **_OP_OPTIONS, **kwargs)
