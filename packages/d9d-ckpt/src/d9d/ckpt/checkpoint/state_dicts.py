"""The model and optimizer state dicts a checkpoint writes from and loads into, and their options.

Both are sharded (DTensors where distributed) and go through torch.distributed.checkpoint; the
options depend on the checkpoint's format version and on whether it holds the trainable state alone.
"""

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from d9d.ckpt.checkpoint.layout import FORMAT_VERSION

__all__ = ["live_state", "quiet_local_dcp", "set_live_state", "state_dict_options"]


def state_dict_options(checkpoint_format: int, *, trainable_only: bool = False) -> StateDictOptions:
    """How the optimizer state is laid out: flattened per parameter name from format 2 on.

    Flattened, every parameter's state and hyperparameters have keys of their own, so ranks that hold
    other parameters (another pipeline degree or schedule) each load their own; nested (format 1),
    the parameter groups are one object that only fits the layout that wrote it. `trainable_only`:
    frozen parameters are neither written nor loaded (so loading is not strict about them).
    """
    return StateDictOptions(
        flatten_optimizer_state_dict=checkpoint_format >= 2,
        ignore_frozen_params=trainable_only,
        strict=not trainable_only,
    )


def live_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    checkpoint_format: int = FORMAT_VERSION,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """The sharded (DTensor where distributed) state dicts to write from or load into."""
    options = state_dict_options(checkpoint_format, trainable_only=trainable_only)
    if optimizer is None:
        return {"model": _without_frozen(model, get_model_state_dict(model, options=options), trainable_only)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": _without_frozen(model, model_state, trainable_only), "optimizer": optim_state}


def set_live_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    checkpoint_format: int,
    *,
    trainable_only: bool = False,
) -> None:
    """Put a loaded `live_state` back into the model (and optimizer)."""
    options = state_dict_options(checkpoint_format, trainable_only=trainable_only)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )


def _without_frozen(model: nn.Module, state: dict[str, Any], trainable_only: bool) -> dict[str, Any]:
    """`state` less every frozen parameter's key. torch's `ignore_frozen_params` misses the second name
    of a shared parameter (a tied LM head: `lm_head.weight` is `embed_tokens.weight`), which would put
    a whole vocabulary table into every adapter checkpoint."""
    if not trainable_only:
        return state
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen}


@contextlib.contextmanager
def quiet_local_dcp() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: that is what local mode means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
