"""Materialize a meta-device model (possibly already sharded) and initialize it identically on any mesh.

Every module that owns parameters or buffers is initialized on a temporary, unsharded copy on the job's
device (a GPU initializes in milliseconds what one CPU thread needs minutes for), seeded by (seed,
module path) — by the root model's `initialize_module(path, module)` when it defines one, else by the
module's own `reset_parameters()` — and each rank then keeps its shard of the result. So the initial
weights do not depend on the mesh (the same job starts from the same model on one device and on a
cluster of the same device type), and no rank holds more than one module's full parameters at a
time. CPU and CUDA random streams differ: `init_device="cpu"` initializes on the CPU anywhere, for
runs that must start bit-identical across device types.

Parameters of FSDP2 units that offload to the host (`trainer.memory.cpu_offload`) are allocated there
(FSDP2 requires it, and pins them on CUDA); buffers and the other parameters on `device`.

Tensors a load fills right after (`loaded`: an import folder's keys) are only allocated, the rank's
shard of them, and zeroed: initializing them would cost a full copy of their module (the embedding and
the LM head are many decoder layers large) for values the load overwrites. What no load fills (the
non-persistent buffers such as rotary frequencies, LoRA adapters) is initialized as without a load,
with the same per-module seeds, so it does not depend on which other tensors were loaded either.
"""

import contextlib
import zlib
from collections.abc import Collection, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.mesh import D9dError
from d9d.parallel import fsdp_parameters

__all__ = ["ModelInitError", "materialize_and_initialize", "shared_parameters"]


class ModelInitError(D9dError, TypeError):
    """A module cannot be initialized (it owns parameters but has no `reset_parameters`), or `loaded`
    names a tensor the model does not hold."""


def materialize_and_initialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    *,
    init_device: torch.device | str | None = None,
    loaded: Collection[str] = (),
) -> None:
    """Allocate `model`'s (local) parameters on `device` and initialize them deterministically.

    Parameters shared by several modules (tied embeddings) stay shared and are initialized once, by
    the first module (in `named_modules` order) that holds them, so a pipeline stage holding only
    one of the users (seeded by the same module path) starts from the same values as one process.

    Args:
        init_device: where the unsharded copies are initialized; default `device`.
        loaded: state-dict keys of `model` that a load fills next (e.g. `d9d.trainer.build.starting_weights.
            imported_keys`): allocated and zeroed, not initialized. A module holding some of them and
            other tensors is initialized whole, as without a load, and keeps only the others' values.
    """
    init_on = torch.device(init_device) if init_device is not None else torch.device(device)
    unknown = sorted(set(loaded) - set(model.state_dict(keep_vars=True))) if loaded else []
    if unknown:
        raise ModelInitError(
            f"loaded names {unknown[:3]}, which the model's state dict does not hold; pass the "
            "state-dict keys (model.state_dict()) that the load fills"
        )
    ties = shared_parameters(model)
    if fsdp_parameters(model, offloaded=True):
        _to_empty_offloaded(model, torch.device(device))
    else:
        model.to_empty(device=device)
    for (module, name), (owner, owner_name) in ties.items():  # to_empty gives each user its own copy
        module._parameters[name] = owner._parameters[owner_name]
    hook = getattr(model, "initialize_module", None)
    done: set[int] = set()  # ids of tensors already initialized (a shared parameter: by its first user)
    with torch.no_grad():
        if loaded:
            state = model.state_dict(keep_vars=True)
            for key in loaded:
                tensor = state[key]
                if id(tensor) not in done:
                    done.add(id(tensor))
                    _local(tensor).zero_()  # no rank ever reads memory nothing wrote
        for path, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
            own = {name: t for name, t in own.items() if id(t) not in done}
            if not own:
                continue
            done.update(id(t) for t in own.values())
            if hook is None and not callable(getattr(module, "reset_parameters", None)):
                raise ModelInitError(
                    f"module {path or '<root>'} ({type(module).__name__}) owns {sorted(own)} but has no "
                    "reset_parameters(); define it (or initialize_module(path, module) on the root model) "
                    "so d9d can initialize the module on any mesh"
                )
            twin = _unsharded_twin(module, init_on)
            with _seeded(init_on, _module_seed(seed, path)):
                if hook is not None:
                    hook(path, twin)
                else:
                    twin.reset_parameters()
            full = dict(twin.named_parameters(recurse=False)) | dict(twin.named_buffers(recurse=False))
            for name, target in own.items():
                _copy_into(target, full[name])


def _to_empty_offloaded(model: nn.Module, device: torch.device) -> None:
    """`to_empty` with the parameters of offloading FSDP2 units on the host and everything else on
    `device` (buffers, parameters no FSDP2 unit manages, e.g. experts left to expert parallelism)."""
    model.to_empty(device="cpu")  # each FSDP2 unit re-registers (and on CUDA pins) its sharded parameters
    if device.type == "cpu":
        return
    managed = {id(p) for p in fsdp_parameters(model)}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
        for name, param in module._parameters.items():
            if param is not None and id(param) not in managed:
                module._parameters[name] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)


def shared_parameters(model: nn.Module) -> dict[tuple[nn.Module, str], tuple[nn.Module, str]]:
    """(module, name) of every repeated use of a parameter → (module, name) of its first use."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties: dict[tuple[nn.Module, str], tuple[nn.Module, str]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first and first[id(param)][0] is not module:
                ties[(module, name)] = first[id(param)]
            else:
                first.setdefault(id(param), (module, name))
    return ties


def _module_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The global RNG of the CPU (and of `device`, a GPU) seeded with `seed`, restored afterwards."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)  # seeds the CPU and every GPU generator
        yield


def _unsharded_twin(module: nn.Module, device: torch.device) -> nn.Module:
    """A shallow copy of `module` without children whose own tensors are full-size plain tensors on `device`."""
    # object.__new__ + a dict copy, not copy.copy: FSDP2's module classes rebuild through __init__
    twin = object.__new__(type(module))
    twin.__dict__.update(module.__dict__)
    twin._modules = {}
    twin._parameters = {
        name: None
        if p is None
        else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        for name, p in module._parameters.items()
    }
    twin._buffers = {
        name: None if b is None else torch.empty(b.shape, dtype=b.dtype, device=device)
        for name, b in module._buffers.items()
    }
    return twin


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(target, DTensor):
        # every rank computed the same full tensor: take the local shard without communication
        shard = distribute_tensor(
            full.to(target.device), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full.to(target.device))
