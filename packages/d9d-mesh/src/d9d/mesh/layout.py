"""Pure arithmetic of the device mesh: domains, their axes, and which global ranks share an axis.

Ranks are laid out row-major over the dense axes (pp outermost, tp innermost), so the tensor-parallel
peers of a rank are its neighbours. Every domain is a reshape of the same rank order, so a rank's
coordinates in all domains agree: the `expert` domain regroups the non-pipeline ranks of a stage
into (ep_replicate, ep_shard) and the `batch` domain merges dp_replicate and dp_shard into `dp`.
No torch here: these functions are what planning, logging and tests check against. numpy only for
the rank grids (`DomainLayout.grid`, `axis_groups`): a log line's rank tag needs none.
"""

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from d9d.mesh.config import MeshConfig

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DOMAINS",
    "DomainLayout",
    "axis_groups",
    "domain_layout",
    "format_layout",
    "format_ranks",
    "rank_coordinates",
    "rank_tag",
]

#: Short tags of the dense axes used in log lines, e.g. "rank 3 pp0 dpr1 tp1".
_AXIS_TAGS = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "dps", "cp": "cp", "tp": "tp"}

#: Domain name → its axis names, outermost first.
DOMAINS: Mapping[str, tuple[str, ...]] = {
    "dense": ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    "expert": ("pp", "ep_replicate", "ep_shard"),
    "batch": ("pp", "dp", "cp", "tp"),
    "world": ("world",),
}


@dataclass(frozen=True)
class DomainLayout:
    """One named sub-mesh: its axis names, their sizes and the grid of global ranks."""

    name: str
    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def grid(self) -> "np.ndarray":
        """Global ranks arranged in the domain's shape (a reshape of 0..world-1)."""
        import numpy as np

        return np.arange(math.prod(self.sizes)).reshape(self.sizes)

    def size(self, axis: str) -> int:
        """Size of one axis of this domain."""
        return self.sizes[self._index(axis)]

    def _index(self, axis: str) -> int:
        if axis not in self.axes:
            raise KeyError(f"domain {self.name!r} has no axis {axis!r}; its axes are {self.axes}")
        return self.axes.index(axis)


def domain_layout(config: MeshConfig, domain: str) -> DomainLayout:
    """The layout of `domain` ("dense", "expert", "batch" or "world") for `config`."""
    sizes_by_domain = {
        "dense": (
            config.pipeline_parallel,
            config.data_parallel_replicate,
            config.data_parallel_shard,
            config.context_parallel,
            config.tensor_parallel,
        ),
        "expert": (config.pipeline_parallel, config.expert_replicate, config.expert_parallel),
        "batch": (
            config.pipeline_parallel,
            config.data_parallel,
            config.context_parallel,
            config.tensor_parallel,
        ),
        "world": (config.world_size,),
    }
    if domain not in sizes_by_domain:
        raise KeyError(f"unknown mesh domain {domain!r}; the domains are {list(DOMAINS)}")
    return DomainLayout(name=domain, axes=DOMAINS[domain], sizes=sizes_by_domain[domain])


def rank_coordinates(config: MeshConfig, rank: int) -> dict[str, dict[str, int]]:
    """Coordinates of global `rank` on every axis of every domain: {domain: {axis: index}}."""
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} is outside a mesh of {config.world_size} ranks")
    coords: dict[str, dict[str, int]] = {}
    for domain in DOMAINS:
        layout = domain_layout(config, domain)
        index = _unravel(rank, layout.sizes)
        coords[domain] = {axis: int(i) for axis, i in zip(layout.axes, index, strict=True)}
    return coords


def _unravel(index: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major coordinates of flat `index` in a grid of `sizes` (numpy's `unravel_index`)."""
    coords = []
    for size in reversed(sizes):
        index, coord = divmod(index, size)
        coords.append(coord)
    return tuple(reversed(coords))


def rank_tag(config: MeshConfig, rank: int) -> str:
    """Short tag for log lines: the rank and its coordinates on axes larger than 1 ("rank 3 dps1 tp1")."""
    coords = rank_coordinates(config, rank)
    parts = [f"rank {rank}"]
    dense = domain_layout(config, "dense")
    for axis, size in zip(dense.axes, dense.sizes, strict=True):
        if size > 1:
            parts.append(f"{_AXIS_TAGS[axis]}{coords['dense'][axis]}")
    if config.expert_parallel > 1:
        parts.append(f"ep{coords['expert']['ep_shard']}")
    return " ".join(parts)


def axis_groups(config: MeshConfig, domain: str, axis: str) -> list[list[int]]:
    """The groups of global ranks that differ only in their coordinate on `axis` of `domain`.

    Each group is one process group of that axis (e.g. the ranks that all-reduce gradients together
    for `dp_replicate`), ordered by coordinate on the axis.
    """
    import numpy as np

    layout = domain_layout(config, domain)
    moved = np.moveaxis(layout.grid, layout._index(axis), -1)
    return [[int(r) for r in row] for row in moved.reshape(-1, layout.size(axis))]


def format_layout(config: MeshConfig, *, max_groups: int = 4) -> str:
    """A human-readable table of every domain and axis: its size and which ranks share it."""
    lines = [f"mesh: {config.describe_degrees()} → world size {config.world_size}"]
    for domain in DOMAINS:
        layout = domain_layout(config, domain)
        shape = " × ".join(f"{a}={s}" for a, s in zip(layout.axes, layout.sizes, strict=True))
        lines.append(f"  {domain:<6} ({shape})")
        for axis, size in zip(layout.axes, layout.sizes, strict=True):
            if size == 1 and domain != "world":
                continue
            groups = axis_groups(config, domain, axis)
            shown = ", ".join(format_ranks(g) for g in groups[:max_groups])
            more = f", … ({len(groups)} groups)" if len(groups) > max_groups else ""
            lines.append(f"    {axis:<13} size {size:<5} groups: {shown}{more}")
    return "\n".join(lines)


def format_ranks(group: list[int]) -> str:
    """Ranks as the layout table writes them: `[0,2]`, `[0..3]`, `[0..12 step 4]`."""
    if len(group) > 2 and all(b - a == group[1] - group[0] for a, b in itertools.pairwise(group)):
        step = group[1] - group[0]
        return f"[{group[0]}..{group[-1]}" + (f" step {step}]" if step != 1 else "]")
    return "[" + ",".join(map(str, group)) + "]"
