"""`torch.compile` per transformer block, in place, so parameter and state-dict names never change.

`module.compile()` (not `torch.compile(module)`, which wraps it and prefixes every key with
`_orig_mod.`): checkpoints and exports of a compiled run are the same files as an eager run's, and
either resumes the other. Compile each block before `parallelize_*` (FSDP2's hooks stay outside the
compiled graph) and after activation checkpointing.
"""

from collections.abc import Iterable

from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel.config import CompileConfig
from d9d.parallel.errors import UnsupportedParallelismError

__all__ = ["CompileConfig", "compile_blocks"]


def compile_blocks(modules: Iterable[nn.Module], config: CompileConfig | None = None) -> list[nn.Module]:
    """Compile each module in place when `config.enabled` (always when `config` is None); idempotent.

    Returns the modules that are compiled now.

    Raises:
        UnsupportedParallelismError: a block is tensor parallel (its backward fails compiled in torch 2.15).
    """
    if config is not None and not config.enabled:
        return []
    modules = list(modules)
    for module in modules:
        for name, param in module.named_parameters():
            names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
            if "tp" in names and param.device_mesh.size(names.index("tp")) > 1:
                raise UnsupportedParallelismError(
                    f"compile_blocks: {name} is tensor parallel; compiling tensor-parallel blocks is not "
                    "supported yet (torch 2.15 fails in their backward when a block's input is an un-waited "
                    "AsyncCollectiveTensor): compile without tensor parallelism"
                )
    fullgraph = config.fullgraph if config is not None else False
    dynamic = config.dynamic if config is not None else None
    done = []
    for module in modules:
        if not getattr(module, "_d9d_compiled", False):
            module.compile(fullgraph=fullgraph, dynamic=dynamic)
            module._d9d_compiled = True  # type: ignore[assignment]
        done.append(module)
    return done
