"""`torch.compile` per transformer block, in place, so parameter and state-dict names never change.

`module.compile()` (not `torch.compile(module)`, which wraps it and prefixes every key with
`_orig_mod.`): checkpoints and exports of a compiled run are the same files as an eager run's, and
either resumes the other. Compile each block before `parallelize_*` (FSDP2's hooks stay outside the
compiled graph) and after activation checkpointing.
"""

from collections.abc import Iterable

import msgspec
from torch import nn

__all__ = ["CompileConfig", "compile_blocks"]


class CompileConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`trainer.compile`: compile each transformer block with `torch.compile` (inductor).

    Attributes:
        enabled: compile, or run eagerly.
        fullgraph: fail on a graph break instead of falling back to eager for that part.
        dynamic: let shapes vary without recompiling (None: torch's automatic choice).
    """

    enabled: bool = False
    fullgraph: bool = False
    dynamic: bool | None = False


def compile_blocks(modules: Iterable[nn.Module], config: CompileConfig | None = None) -> list[nn.Module]:
    """Compile each module in place when `config.enabled` (always when `config` is None); idempotent.

    Returns the modules that are compiled now.
    """
    if config is not None and not config.enabled:
        return []
    fullgraph = config.fullgraph if config is not None else False
    dynamic = config.dynamic if config is not None else False
    done = []
    for module in modules:
        if not getattr(module, "_d9d_compiled", False):
            module.compile(fullgraph=fullgraph, dynamic=dynamic)
            module._d9d_compiled = True  # type: ignore[assignment]
        done.append(module)
    return done
