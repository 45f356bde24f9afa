"""`DataPlacement`: where a rank sits in the batch domain, i.e. which slice of each global batch it loads."""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from d9d.data.errors import DataConfigError
from d9d.mesh import DistributedContext

__all__ = ["DataPlacement", "PipelineStages", "pipeline_ranks"]

#: Which pipeline ranks load data: every one, the first, the last, first and last, or explicit ranks.
PipelineStages = Literal["all", "first", "last", "first_and_last"] | Collection[int]


@dataclass(frozen=True)
class DataPlacement:
    """A rank's data-parallel and pipeline coordinates: all that decides which samples it loads.

    Ranks that differ only in tensor- or context-parallel coordinates share a placement and so get
    identical data. Build it from a `DistributedContext` (`from_context`) or directly, e.g. to
    simulate several DP degrees in one process.
    """

    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for rank, size, axis in ((self.dp_rank, self.dp_size, "dp"), (self.pp_rank, self.pp_size, "pp")):
            if size < 1 or not 0 <= rank < size:
                raise DataConfigError(f"{axis} rank {rank} is outside 0..{size - 1} (size {size})")

    @classmethod
    def from_context(cls, context: DistributedContext) -> "DataPlacement":
        """The placement of this process: `dp` merges dp_replicate and dp_shard (the batch domain)."""
        return cls(
            dp_rank=context.coordinate("dp"),
            dp_size=context.axis_size("dp"),
            pp_rank=context.coordinate("pp"),
            pp_size=context.axis_size("pp"),
        )


def pipeline_ranks(stages: PipelineStages, pp_size: int) -> frozenset[int]:
    """The pipeline ranks `stages` names, of `pp_size`: those whose stages consume data.

    Raises:
        DataConfigError: an unknown name, no rank, or a rank outside 0..pp_size-1.
    """
    named = {
        "all": range(pp_size),
        "first": (0,),
        "last": (pp_size - 1,),
        "first_and_last": (0, pp_size - 1),
    }
    if isinstance(stages, str):
        if stages not in named:
            raise DataConfigError(
                f"pipeline_stages={stages!r} is not one of {sorted(named)} or a collection of pp ranks"
            )
        return frozenset(named[stages])
    ranks = frozenset(int(r) for r in stages)
    bad = sorted(r for r in ranks if not 0 <= r < pp_size)
    if not ranks or bad:
        raise DataConfigError(
            f"pipeline_stages={sorted(ranks)} must name at least one pipeline rank in 0..{pp_size - 1}"
            + (f"; {bad} do not exist" if bad else "")
        )
    return ranks
