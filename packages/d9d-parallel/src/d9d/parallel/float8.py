"""Float8 linears: the matmuls of chosen `nn.Linear` modules in float8, through torchao's float8
training (d9d-parallel's `float8` extra).

`select_float8_linears` decides, from the module tree alone, which linears a `Float8Config` converts
and which it leaves (dimensions not multiples of 16); `apply_float8` converts them in place, before
FSDP (and before activation checkpointing and compile, which then wrap the converted blocks). A
converted linear keeps its float32 `weight` and `bias` parameters under the same names, so state dicts,
checkpoints and exports hold the high-precision weights: a run resumes with float8 turned on or off.

Recipes: `tensorwise` scales each tensor once (dynamic, from its absolute maximum); with
`fsdp_float8_all_gather` (an FSDP2 mesh) the weights are cast to float8 before the all-gather, so
the gather moves one byte a parameter. `rowwise` scales each row; it gathers in high precision.
"""

import re
from dataclasses import dataclass

from torch import nn

from d9d.parallel.config import FLOAT8_KEY, Float8Config
from d9d.parallel.errors import ParallelizeError

__all__ = ["Float8Selection", "apply_float8", "float8_linears", "select_float8_linears"]

#: float8 matmuls (`torch._scaled_mm`) need both dimensions of the weight divisible by this.
FLOAT8_MULTIPLE = 16


@dataclass(frozen=True)
class Float8Selection:
    """Which linears a `Float8Config` converts, and which it matched but leaves, with why."""

    recipe: str
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """E.g. "tensorwise: 12 linears; kept: lm_head (50257 not a multiple of 16)"."""
        text = f"{self.recipe}: {len(self.converted)} linears"
        if self.skipped:
            text += "; kept: " + ", ".join(f"{name} ({why})" for name, why in self.skipped)
        return text


def select_float8_linears(model: nn.Module, config: Float8Config) -> Float8Selection:
    """The `nn.Linear` modules of `model` whose path fully matches `config.modules`, split into those
    float8 takes and those it cannot (a dimension not a multiple of 16).

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
    converted, skipped = [], []
    for name, module in matched:
        bad = [d for d in (module.in_features, module.out_features) if d % FLOAT8_MULTIPLE]
        if bad:
            skipped.append((name, f"{bad[0]} not a multiple of {FLOAT8_MULTIPLE}"))
        else:
            converted.append(name)
    if not converted:
        raise ParallelizeError(
            f"{FLOAT8_KEY} would convert no linear: every one {config.modules!r} matches has a dimension that is "
            f"not a multiple of {FLOAT8_MULTIPLE} (e.g. {skipped[0][0]}: {skipped[0][1]}); turn float8 off"
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


def float8_linears(model: nn.Module) -> list[str]:
    """Paths of the modules of `model` that run float8 matmuls (torchao `Float8Linear`)."""
    return [name for name, module in model.named_modules() if _is_float8(module)]


def _is_float8(module: nn.Module) -> bool:
    return any(
        c.__name__ == "Float8Linear" and c.__module__.startswith("torchao.") for c in type(module).__mro__
    )
