"""Compose transforms: parallel (side by side), sequential (one after another), prefix scope."""

from collections.abc import Callable, Iterable, Mapping

import torch

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._errors import MappingError, format_keys

__all__ = ["Parallel", "Prefix", "SelectOutputs", "Sequential"]


class Parallel(StateMapper):
    """Several mappers side by side over disjoint keys; its groups are theirs.

    Raises:
        MappingError: when two mappers read the same key or write the same key (the keys are listed).
    """

    def __init__(self, mappers: Iterable[StateMapper]) -> None:
        self.mappers = tuple(mappers)
        self._owner: dict[str, int] = {}
        _reject_collisions(self.mappers, "input", lambda m: m.inputs)
        _reject_collisions(self.mappers, "output", lambda m: m.outputs)
        for index, mapper in enumerate(self.mappers):
            for key in mapper.inputs:
                self._owner[key] = index
        self._set_groups(g for m in self.mappers for g in m.groups())

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.mappers[self._owner[next(iter(group.inputs))]].apply(tensors)

    def inverse(self) -> "Parallel":
        """Each part inverted."""
        return Parallel(m.inverse() for m in self.mappers)

    def direct_sources(self) -> dict[str, str]:
        """Union of the parts' direct sources."""
        return {k: v for m in self.mappers for k, v in m.direct_sources().items()}

    def __repr__(self) -> str:
        return f"Parallel(<{len(self.mappers)} mappers>)"


def _reject_collisions(
    mappers: tuple[StateMapper, ...], kind: str, keys_of: Callable[[StateMapper], frozenset[str]]
) -> None:
    first: dict[str, int] = {}
    clashes: dict[str, list[int]] = {}
    for index, mapper in enumerate(mappers):
        for key in keys_of(mapper):
            if key in first:
                clashes.setdefault(key, [first[key]]).append(index)
            else:
                first[key] = index
    if clashes:
        where = "; ".join(
            f"{k!r} by {', '.join(repr(mappers[i]) for i in idx)}" for k, idx in sorted(clashes.items())[:6]
        )
        verb = "read" if kind == "input" else "written"
        raise MappingError(
            f"Parallel: {kind} keys {format_keys(clashes)} are {verb} by more than one mapper ({where}); "
            f"each key must be {verb} by exactly one mapper: remove the duplicate or chain them in a Sequential"
        )


class Sequential(StateMapper):
    """Mappers applied one after another: each stage consumes exactly what the previous one produced.

    Groups of consecutive stages that share keys are merged, so a group of the whole reads only
    original inputs and writes only final outputs (e.g. chunk a fused qkv, then permute q and k).

    Raises:
        MappingError: when a stage reads keys the previous stage does not produce, or a stage's output
            is read by no later stage (pass it on with `Identity` or remove it with `Drop`).
    """

    def __init__(self, mappers: Iterable[StateMapper]) -> None:
        self.mappers = tuple(mappers)
        if not self.mappers:
            raise MappingError("Sequential() needs at least one mapper")
        # plans[g]: per stage, the groups of that stage that belong to merged group g
        plans: list[list[list[MappingGroup]]] = [[[g]] for g in self.mappers[0].groups()]
        for stage, mapper in enumerate(self.mappers[1:], start=1):
            previous = self.mappers[stage - 1]
            if missing := mapper.inputs - previous.outputs:
                raise MappingError(
                    f"Sequential: stage {stage} ({mapper!r}) reads {format_keys(missing)}, which stage "
                    f"{stage - 1} ({previous!r}) does not produce; pass them through the earlier stage with Identity"
                )
            if unread := previous.outputs - mapper.inputs:
                raise MappingError(
                    f"Sequential: outputs {format_keys(unread)} of stage {stage - 1} ({previous!r}) are read by "
                    f"no group of stage {stage} ({mapper!r}); add Identity(...) for them there, or Drop(...)"
                )
            plans = _merge(plans, mapper.groups())
        self._plans = {frozenset().union(*(g.inputs for g in plan[0])): plan for plan in plans}
        self._set_groups(
            MappingGroup(inputs, frozenset().union(*(g.outputs for g in plan[-1])))
            for inputs, plan in self._plans.items()
        )

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        current: Mapping[str, torch.Tensor] = tensors
        for mapper, stage_groups in zip(self.mappers, self._plans[group.inputs], strict=True):
            produced: dict[str, torch.Tensor] = {}
            for g in stage_groups:
                produced.update(mapper.apply({k: current[k] for k in g.inputs}))
            current = produced
        return dict(current)

    def inverse(self) -> "Sequential":
        """Each stage inverted, in reverse order."""
        return Sequential(m.inverse() for m in reversed(self.mappers))

    def direct_sources(self) -> dict[str, str]:
        """Keys that every stage passes on unchanged."""
        direct = self.mappers[0].direct_sources()
        for mapper in self.mappers[1:]:
            direct = {out: direct[mid] for out, mid in mapper.direct_sources().items() if mid in direct}
        return direct

    def __repr__(self) -> str:
        return f"Sequential(<{len(self.mappers)} stages>)"


def _merge(
    plans: list[list[list[MappingGroup]]], next_groups: tuple[MappingGroup, ...]
) -> list[list[list[MappingGroup]]]:
    """Attach each next-stage group to the plans producing its inputs, merging plans it connects."""
    parent = list(range(len(plans)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {key: i for i, plan in enumerate(plans) for g in plan[-1] for key in g.outputs}
    attached: list[tuple[int, MappingGroup]] = []
    for group in next_groups:
        owners = sorted({producer[k] for k in group.inputs})
        for other in owners[1:]:
            parent[find(other)] = find(owners[0])
        attached.append((owners[0], group))
    merged: dict[int, list[list[MappingGroup]]] = {}
    for i, plan in enumerate(plans):
        root = merged.setdefault(find(i), [[] for _ in plan])
        for stage, groups in enumerate(plan):
            root[stage].extend(groups)
    for plan in merged.values():
        plan.append([])
    for owner, group in attached:
        merged[find(owner)][-1].append(group)
    return [merged[root] for root in sorted(merged)]


class Prefix(StateMapper):
    """Scopes a mapper under key prefixes: it reads `prefix + key` and writes `output_prefix + key`.

    Lets one mapper written for a block (`attn.wq.weight`) serve every layer (`layers.3.attn.wq.weight`).
    """

    def __init__(self, prefix: str, mapper: StateMapper, *, output_prefix: str | None = None) -> None:
        self.prefix = prefix
        self.output_prefix = prefix if output_prefix is None else output_prefix
        self.mapper = mapper
        self._set_groups(
            MappingGroup(
                frozenset(prefix + k for k in g.inputs), frozenset(self.output_prefix + k for k in g.outputs)
            )
            for g in mapper.groups()
        )

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cut = len(self.prefix)
        out = self.mapper.apply({k[cut:]: v for k, v in tensors.items()})
        return {self.output_prefix + k: v for k, v in out.items()}

    def inverse(self) -> "Prefix":
        """The inner mapper inverted, with the two prefixes swapped."""
        return Prefix(self.output_prefix, self.mapper.inverse(), output_prefix=self.prefix)

    def direct_sources(self) -> dict[str, str]:
        """The inner direct sources, prefixed."""
        return {self.output_prefix + o: self.prefix + i for o, i in self.mapper.direct_sources().items()}

    def __repr__(self) -> str:
        return f"Prefix({self.prefix!r} -> {self.output_prefix!r}, {self.mapper!r})"


class SelectOutputs(StateMapper):
    """The part of a mapper that writes `keys`: every group still reads its inputs (so the source is
    checked whole), but writes only its outputs among `keys`; a group writing none of them reads nothing.

    Loads a whole-model mapper into part of the model: a pipeline stage takes the keys its layers
    hold, and `load_safetensors` skips the other groups without reading their data.
    """

    def __init__(self, mapper: StateMapper, keys: Iterable[str]) -> None:
        self.mapper = mapper
        self.keys = frozenset(keys)
        self._set_groups(MappingGroup(g.inputs, g.outputs & self.keys) for g in mapper.groups())

    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not group.outputs:
            return {}
        return {k: v for k, v in self.mapper.apply(tensors).items() if k in self.keys}

    def direct_sources(self) -> dict[str, str]:
        """The inner direct sources of the selected keys."""
        return {o: i for o, i in self.mapper.direct_sources().items() if o in self.keys}

    def __repr__(self) -> str:
        return f"SelectOutputs({self.mapper!r}, <{len(self.keys)} keys>)"
