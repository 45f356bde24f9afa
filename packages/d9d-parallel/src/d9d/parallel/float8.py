"""Float8 linears: the matmuls of chosen `nn.Linear` modules in float8, through torchao's float8
training (d9d-parallel's `float8` extra).

`select_float8_linears` decides, from the module tree alone, which linears a `Float8Config` converts
and which it leaves (dimensions not multiples of 16; the output layer unless the pattern names it);
`apply_float8` converts them in place, before FSDP (and before activation checkpointing and compile,
which then wrap the converted blocks). A converted linear keeps its float32 `weight` and `bias`
parameters under the same names, so state dicts, checkpoints and exports hold the high-precision
weights: a run resumes with float8 turned on or off.

The output layer (a linear named `lm_head`, or the module the model's `get_output_embeddings()`
returns) stays in high precision, as torchtitan leaves it: its logits feed the loss directly, over
the whole vocabulary. It is converted only when `Float8Config.modules` spells its name (e.g.
`'.*_proj|lm_head'`); a pattern that matches it through wildcards alone (the default `.*`) keeps it.

Recipes: `tensorwise` scales each tensor once (dynamic, from its absolute maximum); with
`fsdp_float8_all_gather` (an FSDP2 mesh) the weights are cast to float8 before the all-gather, so
the gather moves one byte a parameter, and `precompute_float8_scales` (after each optimizer step)
computes every gathered weight's scale in one all-reduce, instead of one all-reduce of each
weight's absolute maximum at each of its all-gathers. `rowwise` scales each row; it gathers in high
precision.
"""

import re
from collections import Counter
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from d9d.parallel.config import FLOAT8_KEY, Float8Config
from d9d.parallel.errors import ParallelizeError

__all__ = [
    "Float8Selection",
    "apply_float8",
    "float8_gathered_weights",
    "float8_linears",
    "precompute_float8_scales",
    "select_float8_linears",
]

#: float8 matmuls (`torch._scaled_mm`) need both dimensions of the weight divisible by this.
FLOAT8_MULTIPLE = 16
#: Why the output layer stays in high precision, as `Float8Selection.skipped` and "kept:" say it.
OUTPUT_LAYER = "output layer"


@dataclass(frozen=True)
class Float8Selection:
    """Which linears a `Float8Config` converts, and which it matched but leaves, with why."""

    recipe: str
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """E.g. "tensorwise: 8 linears (layers.*.q_proj ×4, layers.*.o_proj ×4); kept: lm_head (output layer)":
        the converted linears with each layer index as `*`."""
        groups = Counter(re.sub(r"\.\d+\.", ".*.", name) for name in self.converted)
        names = ", ".join(f"{group} ×{n}" if n > 1 else group for group, n in groups.items())
        text = f"{self.recipe}: {len(self.converted)} linears ({names})"
        if self.skipped:
            text += "; kept: " + ", ".join(f"{name} ({why})" for name, why in self.skipped)
        return text


def select_float8_linears(model: nn.Module, config: Float8Config) -> Float8Selection:
    """The `nn.Linear` modules of `model` whose path fully matches `config.modules`, split into those
    float8 takes and those it leaves: the output layer unless `config.modules` spells its name (see
    the module docstring), and a dimension not a multiple of 16.

    Raises:
        ParallelizeError: the pattern matches no linear (naming a few that exist), or every linear it
            matches is kept (float8 would change nothing).
    """
    pattern = re.compile(config.modules)
    linears = [
        (name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)
    ]  # FSDP subclasses too
    matched = [(name, m) for name, m in linears if pattern.fullmatch(name)]
    if not matched:
        known = ", ".join(name for name, _ in linears[:6]) or "none"
        raise ParallelizeError(
            f"{FLOAT8_KEY}.modules={config.modules!r} matches no nn.Linear of the model (its linears: {known}"
            f"{', ...' if len(linears) > 6 else ''}); match the whole module path, e.g. '.*(q|k|v|o)_proj'"
        )
    outputs = _output_layers(model)
    converted, skipped = [], []
    for name, module in matched:
        bad = [d for d in (module.in_features, module.out_features) if d % FLOAT8_MULTIPLE]
        if name in outputs and name.rsplit(".", 1)[-1] not in config.modules:
            skipped.append((name, OUTPUT_LAYER))
        elif bad:
            skipped.append((name, f"{bad[0]} not a multiple of {FLOAT8_MULTIPLE}"))
        else:
            converted.append(name)
    if not converted:
        name, why = skipped[0]
        rule = (
            f"modules must spell its name, e.g. '{name.rsplit('.', 1)[-1]}', to convert it"
            if why == OUTPUT_LAYER
            else f"float8 matmuls need both dimensions multiples of {FLOAT8_MULTIPLE}"
        )
        raise ParallelizeError(
            f"{FLOAT8_KEY} would convert no linear: it keeps every one {config.modules!r} matches (e.g. "
            f"{name}: {why}; {rule}); match other linears or turn float8 off"
        )
    return Float8Selection(config.recipe, tuple(converted), tuple(skipped))


def apply_float8(
    model: nn.Module, config: Float8Config, *, fsdp_float8_all_gather: bool = False
) -> Float8Selection:
    """Convert the linears `select_float8_linears` picks to torchao's `Float8Linear`, in place.

    Call it on the model (meta device or materialized) before FSDP, activation checkpointing and
    compile. `fsdp_float8_all_gather`: with the tensorwise recipe, FSDP2 gathers the weights in
    float8 (pass True when the model will be sharded).

    Raises:
        ParallelizeError: torchao is not installed (the extra and the command), or the selection
            fails (see `select_float8_linears`).
    """
    selection = select_float8_linears(model, config)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ParallelizeError(
            f"{FLOAT8_KEY} needs torchao, d9d-parallel's float8 extra: uv pip install 'd9d-parallel[float8]' "
            "(in this workspace: uv sync --inexact --extra float8), or remove trainer.precision.float8"
        ) from None
    chosen = set(selection.converted)
    recipe = Float8LinearConfig.from_recipe_name(config.recipe)
    if config.gathers_float8(fsdp_float8_all_gather):
        recipe = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=recipe, module_filter_fn=lambda _module, name: name in chosen)
    return selection


def float8_gathered_weights(model: nn.Module) -> int:
    """How many float8 linears of `model` FSDP2 all-gathers in float8 (`apply_float8(...,
    fsdp_float8_all_gather=True)` with the tensorwise recipe, then `fully_shard`)."""
    return sum(1 for module in model.modules() if _is_float8(module) and _gathered_in_float8(module.weight))


def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the float8 scale of every weight FSDP2 all-gathers in float8, all in one all-reduce
    (torchao's `precompute_float8_dynamic_scale_for_fsdp`).

    Call it after each optimizer step (and before the first step): every all-gather until the next
    call casts its weights with these scales, instead of all-reducing each weight's absolute maximum
    first (once per weight and all-gather: every microbatch's forward, and its backward when the unit
    reshards after forward). The scales are the ones those all-reduces would give. A no-op without
    such weights (or with a torchao that lacks the function).
    """
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    except ImportError:  # no torchao (no float8 weights either) or one without the precompute
        return
    precompute_float8_dynamic_scale_for_fsdp(model)


def _output_layers(model: nn.Module) -> set[str]:
    """Paths of the model's output layer: linears named `lm_head`, and what `get_output_embeddings()` returns."""
    found = {name for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "lm_head"}
    get_output_embeddings = getattr(model, "get_output_embeddings", None)  # Hugging Face's accessor
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    if isinstance(head, nn.Module):
        found |= {name for name, module in model.named_modules() if module is head}
    return found


def _gathered_in_float8(weight: object) -> bool:
    """A weight FSDP2 holds as torchao's float8-cast-on-gather tensor (no torchao import needed)."""
    local = weight._local_tensor if isinstance(weight, DTensor) else None
    return type(local).__name__ == "WeightWithDynamicFloat8CastTensor"


def float8_linears(model: nn.Module) -> list[str]:
    """Paths of the modules of `model` that run float8 matmuls (torchao `Float8Linear`)."""
    return [name for name, module in model.named_modules() if _is_float8(module)]


def _is_float8(module: nn.Module) -> bool:
    return any(
        c.__name__ == "Float8Linear" and c.__module__.startswith("torchao.") for c in type(module).__mro__
    )
