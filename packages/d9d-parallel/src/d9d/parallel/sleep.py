"""Sleep and wake of the training state: free the accelerator's memory between RL steps, keep every tensor.

    state = TrainingStateSleep(model, optimizer)
    state.sleep()      # parameters, gradients, optimizer states: copied to host memory, device storage freed
    engine.generate()  # the memory is the inference engine's
    state.wake()       # the same storages refilled: training goes on bit-identical

What moves is the *storage* under each tensor, never the tensor: a storage is copied byte for byte to
host memory (pinned on an accelerator) and resized to 0 bytes, the way FSDP2 frees its unsharded
parameters; on wake it is resized back and refilled. So every `nn.Parameter`, gradient and optimizer
state tensor keeps its identity (the optimizer's param groups, hooks and FSDP2's views of its flat
shards still point at them) and a DTensor keeps its mesh and placements. FSDP2 modules are resharded
first (`FSDPModule.reshard()`: a forward without backward may have left unsharded parameters), and on
CUDA the caching allocator's freed blocks go back to the driver (`torch.cuda.empty_cache()`, via
`torch.accelerator.empty_cache()`). The device memory this frees on CUDA is unmeasured (tests ran on
CPU only, where the invariant checked is that every training-state storage is 0 bytes while asleep).

Not training state, so not moved: buffers (rotary tables, running statistics), activations, KV caches,
and anything the caller allocated. A forward or an optimizer step while asleep raises `SleepError`
(reading a freed storage would crash the process).
"""

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from d9d.parallel.errors import SleepError

__all__ = ["TrainingStateSleep", "training_devices"]


class TrainingStateSleep:
    """Moves a model's parameters and gradients and its optimizer's states to host memory and back.

    Sleep between optimizer steps (after `optimizer.step()` or before it, with the gradients kept),
    not between the microbatches of one step with gradient sync off (FSDP2's unsharded accumulated
    gradients are not moved).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._model = model
        self._optimizer = optimizer
        #: While asleep: each freed storage with its host copy.
        self._slept: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._guards: list[RemovableHandle] = []
        self._asleep = False

    @property
    def asleep(self) -> bool:
        """Whether the training state is on the host now."""
        return self._asleep

    def sleep(self) -> int:
        """Copy the training state to host memory and free its device storage; return the bytes moved.

        Raises:
            SleepError: the state is asleep already.
        """
        if self._asleep:
            raise SleepError("the training state is asleep already: call wake() before sleeping again")
        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # frees unsharded parameters a forward without backward left
        storages = _storages(self._tensors())
        accelerated = any(s.device.type != "cpu" for s in storages)
        for storage in storages:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type != "cpu")
            host.copy_(_bytes(storage), non_blocking=True)
            self._slept.append((storage, host))
        if accelerated:
            torch.accelerator.synchronize()  # the copies are done before their sources are freed
        for storage, _ in self._slept:
            storage.resize_(0)
        if accelerated:
            torch.accelerator.empty_cache()
        self._guard()
        self._asleep = True
        return sum(host.numel() for _, host in self._slept)

    def wake(self) -> None:
        """Give every freed storage its bytes back from the host copy (the same storage objects).

        Raises:
            SleepError: the state is not asleep.
        """
        if not self._asleep:
            raise SleepError("the training state is not asleep: call sleep() before wake()")
        accelerated = False
        for storage, host in self._slept:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
            accelerated = accelerated or storage.device.type != "cpu"
        if accelerated:
            torch.accelerator.synchronize()
        self._slept.clear()
        for guard in self._guards:
            guard.remove()
        self._guards.clear()
        self._asleep = False

    def device_bytes(self) -> int:
        """Bytes the training state holds on its training devices now (0 while asleep)."""
        return sum(s.nbytes() for s in _storages(self._tensors(), keep_empty=True))

    def _tensors(self) -> list[torch.Tensor]:
        with torch.no_grad():  # `to_local()` without an autograd node
            return list(_training_state(self._model, self._optimizer))

    def _guard(self) -> None:
        """Refuse a forward or an optimizer step while asleep (first, before FSDP2's own hooks)."""

        def refuse(*_: object) -> None:
            raise SleepError("the training state is asleep: call wake() before a forward or a step")

        self._guards.append(self._model.register_forward_pre_hook(refuse, prepend=True))
        if self._optimizer is not None:
            self._guards.append(self._optimizer.register_step_pre_hook(refuse))


def training_devices(devices: Iterable[torch.device]) -> set[torch.device]:
    """The devices whose memory sleep frees: the accelerators among `devices`, or the CPU where none is.

    State already on the host beside an accelerator (AdamW's step counters, FSDP2's CPU offload) stays.
    """
    devices = set(devices)
    accelerators = {d for d in devices if d.type != "cpu"}
    return accelerators or devices


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """The local tensors of every parameter, its gradient and its optimizer states.

    The optimizer's parameters too: after a forward, FSDP2 modules hold their unsharded parameters.
    """
    groups = optimizer.param_groups if optimizer is not None else []
    for param in [*model.parameters(), *(p for group in groups for p in group["params"])]:
        yield _local(param)
        if param.grad is not None:
            yield _local(param.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storages(tensors: list[torch.Tensor], *, keep_empty: bool = False) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` on their training devices (FSDP2's views share one)."""
    targets = training_devices(t.device for t in tensors)
    seen: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    empty: list[torch.UntypedStorage] = []
    for tensor in tensors:
        if tensor.device not in targets:
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            empty += [storage] if keep_empty else []
            continue
        if not storage.resizable():
            raise SleepError(
                f"a training-state tensor of shape {tuple(tensor.shape)} has a storage that cannot be "
                "freed (not resizable, e.g. from numpy or a memory map): copy it (`.clone()`) first"
            )
        seen.setdefault((storage.device, storage.data_ptr()), storage)  # one address, one storage
    return [*seen.values(), *empty]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
