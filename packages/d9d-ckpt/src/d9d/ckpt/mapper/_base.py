"""The mapper protocol: a set of independent groups (input keys → output keys) and how to apply one."""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from d9d.ckpt.mapper._errors import MappingError, NotInvertibleError, format_keys

__all__ = ["MappingGroup", "StateMapper"]


@dataclass(frozen=True)
class MappingGroup:
    """One unit of work: the output tensors depend on these input tensors and on nothing else."""

    inputs: frozenset[str]
    outputs: frozenset[str]


class StateMapper(ABC):
    """Maps a state (key → tensor) into another key space, one group at a time.

    The groups are declared when the mapper is built, before any tensor exists, so IO can stream:
    a group is applied as soon as its inputs are loaded, and its tensors are freed right after.
    Within one mapper, groups never share an input key or an output key.
    """

    _groups: tuple[MappingGroup, ...]
    _by_inputs: dict[frozenset[str], MappingGroup]

    def _set_groups(self, groups: Iterable[MappingGroup]) -> None:
        groups = tuple(groups)
        seen_in: set[str] = set()
        seen_out: set[str] = set()
        for group in groups:
            if not group.inputs:
                raise MappingError(
                    f"{self!r}: a group must read at least one key (outputs {sorted(group.outputs)})"
                )
            if dup := seen_in & group.inputs:
                raise MappingError(f"{self!r}: input keys {format_keys(dup)} are read by two groups")
            if dup := seen_out & group.outputs:
                raise MappingError(f"{self!r}: output keys {format_keys(dup)} are written by two groups")
            seen_in |= group.inputs
            seen_out |= group.outputs
        self._groups = groups
        self._by_inputs = {g.inputs: g for g in groups}
        self._inputs = frozenset(seen_in)
        self._outputs = frozenset(seen_out)

    def groups(self) -> tuple[MappingGroup, ...]:
        """The independent groups of this mapper, in a stable order."""
        return self._groups

    @property
    def inputs(self) -> frozenset[str]:
        """Every key this mapper reads."""
        return self._inputs

    @property
    def outputs(self) -> frozenset[str]:
        """Every key this mapper writes."""
        return self._outputs

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply one group: `tensors` holds exactly that group's inputs; returns its outputs."""
        group = self._by_inputs.get(frozenset(tensors))
        if group is None:
            raise MappingError(
                f"{self!r}.apply() got keys {format_keys(tensors)}, which are not the inputs of one of its "
                "groups; call apply() once per group of groups() with exactly that group's inputs"
            )
        out = self._apply(group, tensors)
        if set(out) != group.outputs:
            raise MappingError(
                f"{self!r} produced {format_keys(out)} but declared {format_keys(group.outputs)}"
            )
        return out

    @abstractmethod
    def _apply(self, group: MappingGroup, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Compute the outputs of `group` (already validated) from its inputs."""

    def inverse(self) -> "StateMapper":
        """The mapper that undoes this one (outputs back to inputs).

        Raises:
            NotInvertibleError: when the transform loses information.
        """
        raise NotInvertibleError(f"{self!r} is not invertible; write the reverse mapping explicitly")

    def direct_sources(self) -> dict[str, str]:
        """Output keys whose tensor is an input tensor unchanged (a rename), mapped to that input key.

        IO uses it to read only the local shard of such tensors from a file.
        """
        return {}
