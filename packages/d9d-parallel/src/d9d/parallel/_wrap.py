"""Wrapping a module's forward in place, so that copies of the module (deepcopy) wrap their own weights."""

import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["wrap_forward"]

#: wrapper(inner, module, *args, **kwargs): call `inner(module, *args, **kwargs)` somehow.
Wrapper = Callable[..., Any]


def wrap_forward(module: nn.Module, wrapper: Wrapper) -> None:
    """Make `module.forward(*a, **k)` run `wrapper(inner, module, *a, **k)`, `inner` being the forward before.

    The new forward is a method bound to `module` whose closure holds only unbound functions, so
    `copy.deepcopy(module)` rebinds it to the copy (a closure over the bound method would run the
    original's weights).
    """
    current = module.forward
    inner = current.__func__ if isinstance(current, types.MethodType) else _unbound(current)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return wrapper(inner, self, *args, **kwargs)

    forward.__doc__ = getattr(inner, "__doc__", None)
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def _unbound(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        del self
        return function(*args, **kwargs)

    return call
