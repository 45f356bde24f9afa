"""LoRA: train low-rank adapters beside frozen `nn.Linear` weights, in PEFT's layout.

`apply_lora` keeps each matching `nn.Linear` (its weight stays at `<path>.weight`), adds two
submodules `lora_A` ([rank, in], kaiming-uniform) and `lora_B` ([out, rank], zeros) and wraps its
forward in place:

    y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank

so adapter parameters are `<path>.lora_A.weight` / `<path>.lora_B.weight`, PEFT's names without the
`base_model.model.` prefix (`peft_key`). Every other parameter of the model is frozen.

Order with the other mechanisms: build (meta is fine) → `parallelize_tensor_parallel` →
`apply_lora` → `parallelize_hsdp`/`fsdp`/`replicate` → materialize. LoRA may also come first (at
build time) if tensor parallelism runs inside `with lora_detached(model):` (torch's column-/row-wise
styles cannot partition a Linear that has children). On a tensor-parallel Linear the adapters follow
the base weight's placements (column-wise: `lora_B` sharded on the output dim, `lora_A` replicated;
row-wise: `lora_A` sharded on the input dim, `lora_B` replicated); those replicated adapters get
`Partial` gradients, which `d9d.parallel.reduce_partial_grads` reduces before the optimizer step
(the trainer's step does). FSDP2 then shards frozen and adapter parameters alike; only adapters get
gradients and optimizer state.
"""

import contextlib
import math
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from d9d.parallel._wrap import wrap_forward
from d9d.parallel.config import LORA_KEY as _KEY
from d9d.parallel.config import LoraConfig
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "LoraA",
    "LoraB",
    "LoraConfig",
    "LoraError",
    "apply_lora",
    "lazily_merged_state",
    "lora_detached",
    "lora_parameter_names",
    "lora_parameters",
    "lora_state_dict",
    "merge_lora",
    "merged_state_dict",
    "peft_adapter_config",
    "peft_key",
    "peft_state_dict",
]

#: Set on every Linear whose forward `apply_lora` wrapped: its LoRA scale (alpha / rank).
_SCALE_ATTR = "_d9d_lora_scale"
#: Set on a root model whose `initialize_module` hook `apply_lora` wrapped.
_HOOK_ATTR = "_d9d_lora_init_hook"


class LoraError(ParallelizeError):
    """LoRA cannot be applied as asked (no module matches, wrong order with FSDP, unknown layout)."""


class _LoraWeight(nn.Module):
    """One adapter matrix as a module with a `weight`, so its key is `<path>.lora_A.weight` as in PEFT."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        return f"in_features={in_features}, out_features={out_features}"


class LoraA(_LoraWeight):
    """The down projection [rank, in]: kaiming-uniform (a=√5) as PEFT initializes it."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class LoraB(_LoraWeight):
    """The up projection [out, rank]: zeros, so a fresh adapter leaves the model unchanged."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Add LoRA adapters to every `nn.Linear` of `model` whose path matches `config.target_modules`.

    Freezes every other parameter (`requires_grad=False`). Works on the meta device: the adapters
    are then empty, and d9d's materialization initializes them (their `reset_parameters`, also when
    the root model defines `initialize_module`, whose hook is wrapped so it cannot touch them).
    On a real device `lora_A` draws from the global RNG: seed every rank alike, as for the base
    weights (tensor-parallel adapters take rank 0's draw). Pass the root model, call it after tensor
    parallelism (or see `lora_detached`) and before data parallelism. Idempotent.

    Returns:
        the paths of the adapted modules, in module order.

    Raises:
        LoraError: when no `nn.Linear` matches, or the model is already FSDP-sharded, or a base
            weight has a placement an adapter cannot follow.
    """
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise LoraError(
            "apply_lora: the model is already data-parallel (FSDP2); apply LoRA before "
            "parallelize_hsdp/fsdp/replicate, so the adapters are sharded with their blocks"
        )
    patterns = [re.compile(p) for p in config.target_modules]
    targets = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(p.fullmatch(path) for p in patterns)
    ]
    if not targets:
        linears = [path for path, m in model.named_modules() if isinstance(m, nn.Linear)]
        shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
        raise LoraError(
            f"{_KEY}.target_modules {config.target_modules} match no nn.Linear of "
            f"{type(model).__name__} (its Linear modules: {shown or 'none'}); patterns match whole paths"
        )
    for path, module in targets:
        if not isinstance(getattr(module, "lora_A", None), LoraA):
            _adapt(path, module, config)
    _freeze_all_but_adapters(model)
    _wrap_init_hook(model)
    return [path for path, _ in targets]


def _adapt(path: str, linear: nn.Linear, config: LoraConfig) -> None:
    weight = linear.weight
    out_features, in_features = weight.shape
    device, dtype = _local(weight).device, weight.dtype
    lora_a = LoraA(torch.empty(config.rank, in_features, device=device, dtype=dtype))
    lora_b = LoraB(torch.empty(out_features, config.rank, device=device, dtype=dtype))
    if device.type != "meta":
        lora_a.reset_parameters()
        lora_b.reset_parameters()
    _attach(path, linear, lora_a, lora_b, nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity())
    if not hasattr(linear, _SCALE_ATTR):  # wrapped once; a merged module only gets new adapters
        wrap_forward(linear, _lora_forward)
    setattr(linear, _SCALE_ATTR, config.scale)


def _attach(path: str, linear: nn.Linear, lora_a: LoraA, lora_b: LoraB, dropout: nn.Module) -> None:
    """Register the adapters on `linear`, as DTensors that follow its weight's placements if it is one."""
    weight = linear.weight
    if isinstance(weight, DTensor):
        a_placements, b_placements = _adapter_placements(path, weight)
        for module, placements in ((lora_a, a_placements), (lora_b, b_placements)):
            if not isinstance(module.weight, DTensor):
                # src_data_rank=0: every rank gets rank 0's values (its kaiming draw), whatever its RNG
                full = module.weight.detach()
                module.weight = nn.Parameter(distribute_tensor(full, weight.device_mesh, placements))
    linear.lora_A = lora_a
    linear.lora_B = lora_b
    linear.lora_dropout = dropout


@contextlib.contextmanager
def lora_detached(model: nn.Module) -> Iterator[None]:
    """Take the adapters off their Linear modules inside the block, put them back (distributed) after.

    For tensor parallelism after `apply_lora` (e.g. LoRA applied at build time):

        with lora_detached(model):
            parallelize_tensor_parallel(model, mesh, plan)

    On exit each adapter becomes a DTensor that follows its base weight's new placements, and every
    non-adapter parameter is frozen again (some tensor-parallel styles re-create parameters trainable).
    """
    detached = []
    for path, module in model.named_modules():
        if isinstance(getattr(module, "lora_A", None), LoraA):
            detached.append((path, module, module.lora_A, module.lora_B, module.lora_dropout))
    for _, module, *_ in detached:
        del module.lora_A, module.lora_B, module.lora_dropout
    try:
        yield
    finally:
        for path, module, lora_a, lora_b, dropout in detached:
            _attach(path, module, lora_a, lora_b, dropout)
        if detached:
            _freeze_all_but_adapters(model)


#: Set on an adapted Linear inside `lora_disabled`: its adapter adds nothing.
_OFF_ATTR = "_d9d_lora_off"


@contextlib.contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone inside the block: no adapter of `model` adds to its Linear's output (e.g. the
    reference policy of preference optimization with LoRA: the starting weights, at no memory cost).
    Nothing moves or is re-created; every adapter is back on exit."""
    adapted = [m for m in model.modules() if isinstance(getattr(m, "lora_A", None), LoraA)]
    for module in adapted:
        setattr(module, _OFF_ATTR, True)
    try:
        yield
    finally:
        for module in adapted:
            setattr(module, _OFF_ATTR, False)


def _freeze_all_but_adapters(model: nn.Module) -> None:
    adapters = {id(p) for p in lora_parameters(model)}
    for param in model.parameters():
        if id(param) not in adapters:
            param.requires_grad_(False)


def _adapter_placements(path: str, weight: torch.Tensor) -> tuple[list[Placement], list[Placement]]:
    """Placements of A [rank, in] and B [out, rank] that follow W [out, in]'s: A shares dim 1, B dim 0."""
    if not isinstance(weight, DTensor):
        return [], []
    a: list[Placement] = []
    b: list[Placement] = []
    for placement in weight.placements:
        if isinstance(placement, Replicate):
            a.append(Replicate())
            b.append(Replicate())
        elif isinstance(placement, Shard) and placement.dim in (0, -2):  # column-wise: out dim split
            a.append(Replicate())
            b.append(Shard(0))
        elif isinstance(placement, Shard) and placement.dim in (1, -1):  # row-wise: in dim split
            a.append(Shard(1))
            b.append(Replicate())
        else:
            raise LoraError(
                f"apply_lora: {path}.weight has placements {weight.placements}; LoRA supports "
                "Replicate and Shard(0)/Shard(1) (column-/row-wise tensor parallelism) before FSDP"
            )
    return a, b


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _lora_forward(
    inner: Callable[..., Any], self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    out = inner(self, x, *args, **kwargs)
    lora_a = getattr(self, "lora_A", None)
    if lora_a is None or getattr(self, _OFF_ATTR, False):  # merged by merge_lora, or `lora_disabled`
        return out
    return out + self.lora_B(lora_a(self.lora_dropout(x))) * getattr(self, _SCALE_ATTR)


def _wrap_init_hook(model: nn.Module) -> None:
    """Route LoRA modules past the root's `initialize_module` (it would init B like any Linear weight)."""
    current = getattr(model, "initialize_module", None)
    if current is None or getattr(model, _HOOK_ATTR, False):
        return
    inner = current.__func__ if isinstance(current, types.MethodType) else _unbound(current)

    def initialize_module(self: nn.Module, path: str, module: nn.Module) -> None:
        if isinstance(module, LoraA | LoraB):
            module.reset_parameters()
        else:
            inner(self, path, module)

    # bound to the instance with only unbound functions in the closure: deepcopy rebinds it
    model.initialize_module = types.MethodType(initialize_module, model)  # type: ignore[method-assign]
    setattr(model, _HOOK_ATTR, True)


def _unbound(function: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        del self
        return function(*args, **kwargs)

    return call


def _adapter_modules(model: nn.Module) -> Iterator[tuple[str, _LoraWeight]]:
    for path, module in model.named_modules():
        if isinstance(module, LoraA | LoraB):
            yield path, module


def lora_parameter_names(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (`<path>.lora_A.weight`, `<path>.lora_B.weight`), in module order."""
    return [f"{path}.weight" for path, _ in _adapter_modules(model)]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters: what the optimizer trains (`AdamW(lora_parameters(model))`)."""
    return [module.weight for _, module in _adapter_modules(model)]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter-only state under d9d's names (DTensors stay DTensors; gather them to export)."""
    return {f"{path}.weight": module.weight.detach() for path, module in _adapter_modules(model)}


def peft_key(name: str) -> str:
    """PEFT's key of a d9d adapter name: `q.lora_A.weight` → `base_model.model.q.lora_A.weight`."""
    return f"base_model.model.{name}"


def peft_state_dict(
    model: nn.Module, *, rename: Callable[[str], str] | Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters as PEFT's `adapter_model.safetensors` holds them: full, contiguous, PEFT keys.

    Args:
        rename: maps a d9d module path to the base model's (Hugging Face) one where they differ,
            e.g. `{"blocks.0.attn.q": "model.layers.0.self_attn.q_proj"}` or a function.
    """
    out = {}
    for path, module in _adapter_modules(model):
        owner, _, matrix = path.rpartition(".")
        if rename is not None:
            owner = rename(owner) if callable(rename) else rename.get(owner, owner)
        weight = module.weight.detach()
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        out[peft_key(f"{owner}.{matrix}.weight")] = weight.contiguous().clone()
    return out


def peft_adapter_config(
    config: LoraConfig,
    base_model_name_or_path: str,
    *,
    target_modules: Sequence[str] | None = None,
    task_type: str | None = "CAUSAL_LM",
) -> dict[str, Any]:
    """The `adapter_config.json` content `peft.PeftModel.from_pretrained` loads the adapters with.

    Args:
        target_modules: exact module paths of the base model (e.g. `apply_lora`'s result, renamed
            to the base model's names); default the config's patterns as one regex, which PEFT
            full-matches against the base model's module paths like `apply_lora` does.
        task_type: PEFT's task type (`CAUSAL_LM` gives a `PeftModelForCausalLM`); None for a bare model.
    """
    if target_modules is None:
        patterns = config.target_modules
        targets: str | list[str] = (
            patterns[0] if len(patterns) == 1 else "|".join(f"(?:{p})" for p in patterns)
        )
    else:
        targets = list(target_modules)
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def _merged_weight(module: nn.Module) -> torch.Tensor:
    """W + B @ A * scale of one adapted Linear, in W's dtype and (DTensor) placements."""
    weight = module.weight.detach()
    delta = (module.lora_B.weight.detach() @ module.lora_A.weight.detach()) * getattr(module, _SCALE_ATTR)
    if isinstance(weight, DTensor) and isinstance(delta, DTensor):
        delta = delta.redistribute(weight.device_mesh, weight.placements)
    return weight + delta.to(weight.dtype)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its base weight, the adapters left out.

    What `merge_lora` would leave, without changing the model, and on any layout: under FSDP2 and
    tensor parallelism the merged weights are DTensors with their base weight's placements (each
    `B @ A` gathers only the small factors), so an exporter streams them shard by shard. Keys are the
    base model's (`<path>.weight`), ready for the provider's export mapper. The merged weights are
    new tensors: the dict holds a second copy of this rank's share of every adapted weight
    (`lazily_merged_state` makes them one at a time).
    """
    state, merge = lazily_merged_state(model)
    return {key: merge(key, tensor) for key, tensor in state.items()}


def lazily_merged_state(
    model: nn.Module,
) -> tuple[dict[str, torch.Tensor], Callable[[str, torch.Tensor], torch.Tensor]]:
    """`merged_state_dict`'s keys with the base weights standing in for the merged ones (same shapes,
    dtypes and placements), and `merge(key, tensor)`, which gives a key's merged weight (any other
    key's tensor as it is) when it is needed: an exporter merges one weight at a time.

    `merge` runs collectives on a sharded weight: every rank holding the key calls it, in one order.
    """
    state = dict(model.state_dict())
    adapted: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if isinstance(getattr(module, "lora_A", None), LoraA):
            prefix = f"{path}." if path else ""
            adapted[f"{prefix}weight"] = module
            for key in (f"{prefix}lora_A.weight", f"{prefix}lora_B.weight"):
                state.pop(key, None)

    @torch.no_grad()
    def merge(key: str, tensor: torch.Tensor) -> torch.Tensor:
        module = adapted.get(key)
        return tensor if module is None else _merged_weight(module)

    return state, merge


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold each adapter into its base weight (W += B @ A * scale) and remove it; returns the paths.

    The model then computes what it computed with the adapters (without dropout) and its state dict
    is the base model's, ready for a merged export. Runs on an unsharded or tensor-parallel-only
    model (FSDP-sharded ones are refused); the merged weights keep their `requires_grad=False`.
    """
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise LoraError(
            "merge_lora: the model is FSDP-sharded; load its full state dict (with the adapters) into an "
            "unsharded copy built with apply_lora and merge that one"
        )
    merged = []
    for path, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, LoraA):
            continue
        module.weight.copy_(_merged_weight(module))
        del module.lora_A, module.lora_B, module.lora_dropout
        merged.append(path)
    return merged
