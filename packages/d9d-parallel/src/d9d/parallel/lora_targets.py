"""What `peft.lora.target_modules` adapt, per layer, and the projections they leave without adapters.

Patterns written for one model family can miss another's linears: Phi-3 fuses q/k/v into `qkv_proj`
and gate/up into `gate_up_proj`, so `.*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)`
adapts only its `o_proj` and `down_proj`, and `apply_lora` cannot tell (some Linear matched).
`lora_coverage` counts what each pattern matches in each layer (a layer: a module path up to its
first numeric part, `model.layers.3`) and finds the missed projections: an `nn.Linear` left without
an adapter whose name says which projections it holds (q, k, v, o, gate, up, down, fused ones like
`qkv_proj`, `gate_up_proj`, `query_key_value` too) where a pattern matches the usual name of one of
them (`q_proj`, ..., `down_proj`) at the same place. So `.*\\.(q_proj|v_proj)` on Llama misses
nothing (its `k_proj` is left out by choice), but on Phi-3 it misses `qkv_proj`.
`LoraCoverage.warning()` says what is off in one line, with the fix.
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from d9d.parallel.config import LORA_KEY, LoraConfig
from d9d.parallel.lora import LoraA

__all__ = ["LoraCoverage", "MissedProjection", "PatternCoverage", "lora_coverage"]

#: A name part → the projections it stands for.
_ROLES = {
    "q": ("q",), "query": ("q",), "k": ("k",), "key": ("k",), "v": ("v",), "value": ("v",),
    "o": ("o",), "out": ("o",), "qkv": ("q", "k", "v"), "wqkv": ("q", "k", "v"), "kv": ("k", "v"),
    "gate": ("gate",), "up": ("up",), "down": ("down",),
}  # fmt: skip
#: Name parts that make a one-projection name a projection on their own (a bare `gate` is an MoE router).
_PROJECTION_WORDS = frozenset({"proj", "query", "key", "value"})
#: The name each projection usually has (Llama's), which target patterns are written against.
_USUAL_NAMES = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
}  # fmt: skip


@dataclass(frozen=True)
class PatternCoverage:
    """What one pattern of `target_modules` matched.

    Attributes:
        pattern: the pattern, as configured.
        per_layer: the `nn.Linear` modules it matched in each layer (`LoraCoverage.layers` order).
        outside: those it matched outside every layer (e.g. the LM head).
    """

    pattern: str
    per_layer: tuple[int, ...]
    outside: int

    @property
    def total(self) -> int:
        """Every module it matched."""
        return sum(self.per_layer) + self.outside


@dataclass(frozen=True)
class MissedProjection:
    """Linears of one name left without adapters although the patterns name what they hold.

    Attributes:
        name: the module's own name, e.g. `qkv_proj`.
        holds: the projections its name says it holds, e.g. ("q", "k", "v").
        named: the usual names of those the patterns match, e.g. ("q_proj", "k_proj", "v_proj").
        paths: every such module path, in module order.
    """

    name: str
    holds: tuple[str, ...]
    named: tuple[str, ...]
    paths: tuple[str, ...]


@dataclass(frozen=True)
class LoraCoverage:
    """Per pattern, the adapted modules per layer, and the projections the patterns miss.

    Attributes:
        layers: the layer paths (`model.layers.0`, ...), in module order.
        patterns: one entry per pattern of `target_modules`, in their order.
        missed: the missed projections, one entry per module name.
        whole_model: False when the model holds only some layers (pipeline stages): a pattern that
            matches nothing here may match elsewhere, so `warning()` does not say so.
    """

    layers: tuple[str, ...]
    patterns: tuple[PatternCoverage, ...]
    missed: tuple[MissedProjection, ...]
    whole_model: bool = True

    def describe(self) -> str:
        """Each pattern and what it matched: `.*\\.q_proj: 1 in each of 4 layers`."""
        return "; ".join(f"{p.pattern}: {self._matches(p)}" for p in self.patterns)

    def warning(self) -> str | None:
        """One line on what looks unintended (projections missed, a pattern that matches nothing in
        some layers or at all) and the fix; None when nothing does."""
        parts = []
        if self.missed:
            held = " and ".join(
                f"{m.name} (holding {'/'.join(m.holds)}; the patterns name {'/'.join(m.named)})"
                for m in self.missed
            )
            paths = [path for m in self.missed for path in m.paths]
            layers = {_layer(path) for path in paths} - {None}
            where = (
                f"in {len(layers)} layer{'s' if len(layers) > 1 else ''}" if layers else "outside the layers"
            )
            fix = "|".join(m.name for m in self.missed)
            parts.append(
                f"{LORA_KEY}.target_modules leave {held} without adapters {where} (e.g. {paths[0]}); "
                f"add '.*\\.({fix})' to {LORA_KEY}.target_modules"
            )
        for pattern in self.patterns:
            if pattern.total == 0 and self.whole_model:
                parts.append(f"pattern '{pattern.pattern}' of {LORA_KEY}.target_modules matches no nn.Linear")
            elif 0 in pattern.per_layer and any(pattern.per_layer):
                empty = [self.layers[i] for i, n in enumerate(pattern.per_layer) if n == 0]
                shown = ", ".join(empty[:4]) + (f" and {len(empty) - 4} more" if len(empty) > 4 else "")
                parts.append(
                    f"pattern '{pattern.pattern}' of {LORA_KEY}.target_modules matches nothing in {shown}"
                )
        return "; ".join(parts) or None

    def _matches(self, pattern: PatternCoverage) -> str:
        """`7 in each of 4 layers`; `7 in model.layers.0..1, 3 in model.layers.2..3`; `1 outside the
        layers`."""
        counts = pattern.per_layer
        runs: list[tuple[int, list[int]]] = []
        for index, n in enumerate(counts):
            if runs and runs[-1][0] == n:
                runs[-1][1].append(index)
            else:
                runs.append((n, [index]))
        if len(runs) == 1:
            plural = "s" if len(counts) > 1 else ""
            texts = [f"{counts[0]} in each of {len(counts)} layer{plural}"]
        else:
            texts = [f"{n} in {self._span(indices)}" for n, indices in runs]
        if pattern.outside or not counts:
            texts.append(f"{pattern.outside} outside the layers")
        return ", ".join(texts)

    def _span(self, indices: list[int]) -> str:
        first, last = self.layers[indices[0]], self.layers[indices[-1]]
        return first if len(indices) == 1 else f"{first}..{last.rpartition('.')[2]}"


def lora_coverage(
    modules: nn.Module | Sequence[nn.Module], config: LoraConfig, *, whole_model: bool = True
) -> LoraCoverage:
    """Count what `config.target_modules` match per layer in a model `apply_lora` adapted, and find the
    projections they miss (see the module's docstring).

    Args:
        modules: the model, or its stage modules (pipeline chunks under the whole model's names).
        whole_model: False for some stages of a pipeline (see `LoraCoverage.whole_model`).
    """
    linears = dict(_linears([modules] if isinstance(modules, nn.Module) else modules))
    layer_of = {path: _layer(path) for path in linears}
    layers = tuple(dict.fromkeys(layer for layer in layer_of.values() if layer is not None))
    index = {layer: i for i, layer in enumerate(layers)}
    patterns = [re.compile(p) for p in config.target_modules]
    found = []
    for text, pattern in zip(config.target_modules, patterns, strict=True):
        per_layer, outside = [0] * len(layers), 0
        for path in linears:
            if pattern.fullmatch(path):
                layer = layer_of[path]
                if layer is None:
                    outside += 1
                else:
                    per_layer[index[layer]] += 1
        found.append(PatternCoverage(text, tuple(per_layer), outside))
    return LoraCoverage(layers, tuple(found), _missed(linears, patterns), whole_model)


def _linears(roots: Iterable[nn.Module]) -> Iterable[tuple[str, nn.Module]]:
    """Every `nn.Linear` (not an adapter) of `roots` by path, each path once."""
    seen: set[str] = set()
    for root in roots:
        for path, module in root.named_modules():
            if isinstance(module, nn.Linear) and path not in seen:
                seen.add(path)
                yield path, module


def _missed(linears: dict[str, nn.Module], patterns: list[re.Pattern[str]]) -> tuple[MissedProjection, ...]:
    """The projections without adapters whose usual names the patterns match at the same place."""
    found: dict[str, MissedProjection] = {}
    for path, module in linears.items():
        if isinstance(getattr(module, "lora_A", None), LoraA):
            continue
        parent, _, name = path.rpartition(".")
        holds = _projections_of(name)
        prefix = f"{parent}." if parent else ""
        named = tuple(
            _USUAL_NAMES[p] for p in holds if any(r.fullmatch(prefix + _USUAL_NAMES[p]) for r in patterns)
        )
        if not named:
            continue
        before = found.get(name)
        paths = (*before.paths, path) if before is not None else (path,)
        found[name] = MissedProjection(name, holds, named if before is None else before.named, paths)
    return tuple(found.values())


def _projections_of(name: str) -> tuple[str, ...]:
    """The projections a Linear's own name says it holds: `qkv_proj` → (q, k, v), `gate_up_proj` →
    (gate, up), `query_key_value` → (q, k, v), `o_proj` → (o,); () for other names (`lm_head`, an MoE
    router's `gate`, `fc1`)."""
    parts = [part for part in re.split(r"[\W_]+", name.lower()) if part]
    holds = tuple(dict.fromkeys(role for part in parts for role in _ROLES.get(part, ())))
    if len(holds) > 1 or (holds and _PROJECTION_WORDS.intersection(parts)):
        return holds
    return ()


def _layer(path: str) -> str | None:
    """The layer a module path is in (its path up to its first numeric part), None outside the layers."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None
