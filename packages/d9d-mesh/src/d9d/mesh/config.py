"""`MeshConfig`: the parallelism degrees of a job (the `mesh:` section of a config)."""

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from d9d.mesh.errors import MeshConfigError

__all__ = ["AUTO", "DEGREE_KEYS", "MeshConfig", "resolve_auto_degree"]

#: The value of the one degree that takes the rest of the world (`mesh.data_parallel_shard: auto`).
AUTO = "auto"

#: Degree keys in the order of the dense mesh axes (outermost first), expert_parallel last.
DEGREE_KEYS: tuple[str, ...] = (
    "pipeline_parallel",
    "data_parallel_replicate",
    "data_parallel_shard",
    "context_parallel",
    "tensor_parallel",
    "expert_parallel",
)


class MeshConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Parallelism degrees. All default to 1; all degrees 1 means a plain single-process job.

    The number of processes is the product of every degree except `expert_parallel`, which only
    regroups ranks the other degrees already count: it must divide
    data_parallel_replicate × data_parallel_shard × context_parallel × tensor_parallel.
    """

    pipeline_parallel: int = 1
    data_parallel_replicate: int = 1
    data_parallel_shard: int = 1
    context_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        for key in DEGREE_KEYS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise MeshConfigError(
                    f"mesh.{key} must be an integer >= 1, got {value!r} ({type(value).__name__})"
                )
            if value < 1:
                raise MeshConfigError(
                    f"mesh.{key} must be >= 1, got {value}; use 1 to switch this parallelism off"
                )
        if self.non_pipeline_size % self.expert_parallel != 0:
            raise _expert_parallel_error(self.expert_parallel, self.non_pipeline_size)

    @property
    def data_parallel(self) -> int:
        """Number of data-parallel ranks: data_parallel_replicate × data_parallel_shard."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def non_pipeline_size(self) -> int:
        """Ranks in one pipeline stage: dp_replicate × dp_shard × cp × tp (what expert_parallel regroups)."""
        return self.data_parallel * self.context_parallel * self.tensor_parallel

    @property
    def expert_replicate(self) -> int:
        """How many copies of each expert shard exist: non_pipeline_size / expert_parallel."""
        return self.non_pipeline_size // self.expert_parallel

    @property
    def world_size(self) -> int:
        """Processes this mesh needs: the product of all degrees except expert_parallel."""
        return self.pipeline_parallel * self.non_pipeline_size

    @property
    def is_local(self) -> bool:
        """True when every degree is 1: the job runs as a plain process, no process group."""
        return self.world_size == 1

    def describe_degrees(self) -> str:
        """The degrees that are not 1, as `key=value` pairs (or `all degrees 1`)."""
        parts = [f"{key}={getattr(self, key)}" for key in DEGREE_KEYS if getattr(self, key) != 1]
        return ", ".join(parts) if parts else "all degrees 1"


def resolve_auto_degree(mesh: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """A raw `mesh:` section with its `auto` degree (at most one) set to what `world_size` leaves it:
    the world divided by the product of the other degrees (expert_parallel does not count, but must
    divide the ranks of a pipeline stage that the resolved degrees make).

    So one config runs on whatever world the launcher hands it, e.g. under torchrun's elastic agent
    after a node left or joined. Values that are not integers are left for the schema to refuse.

    Raises:
        MeshConfigError: more than one `auto`, `auto` on expert_parallel, or a world that the other
            degrees (with expert_parallel: pipeline_parallel × expert_parallel) do not divide.
    """
    autos = [key for key, value in mesh.items() if value == AUTO]
    if not autos:
        return dict(mesh)
    if len(autos) > 1:
        raise MeshConfigError(
            f"mesh.{autos[0]} and mesh.{autos[1]} are both auto; at most one degree takes the rest of the "
            "world: give the others numbers"
        )
    (key,) = autos
    if key == "expert_parallel":
        raise MeshConfigError(
            "mesh.expert_parallel cannot be auto: it regroups ranks the other degrees count and adds none; "
            "make a data-parallel degree auto and set expert_parallel to a number"
        )
    if key not in DEGREE_KEYS:
        return dict(mesh)  # an unknown key: the schema names it
    others = math.prod(_number(mesh, other) for other in DEGREE_KEYS[:-1] if other != key)
    pipeline, expert = _number(mesh, "pipeline_parallel"), _number(mesh, "expert_parallel")
    if key == "pipeline_parallel":  # a stage is what the numbers make it, whatever the world
        if others % expert != 0:
            raise _expert_parallel_error(expert, others)
        step = others
    else:  # a stage holds world / pipeline_parallel ranks: expert_parallel must divide them too
        step = math.lcm(others, pipeline * expert)
    if world_size % step == 0:
        return {**mesh, key: world_size // others}
    if step == others:
        raise MeshConfigError(
            f"mesh.{key}: auto needs a world of a multiple of {others} processes (the product of the other "
            f"degrees), but {world_size} were launched; launch a multiple of {others} or set mesh.{key} "
            "to a number"
        )
    if world_size % others != 0:
        raise MeshConfigError(
            f"mesh.{key}: auto needs a world of a multiple of {step} processes (of {others}, the product of "
            f"the other degrees, and of pipeline_parallel × expert_parallel = {pipeline * expert}, so that "
            f"mesh.expert_parallel={expert} divides each pipeline stage), but {world_size} were launched; "
            f"launch a multiple of {step} processes"
        )
    stage = world_size // pipeline
    raise MeshConfigError(
        f"mesh.{key}: auto is {world_size // others} on {world_size} processes, so a pipeline stage holds "
        f"{stage} ranks, which mesh.expert_parallel={expert} does not divide; launch a multiple of {step} "
        f"processes or set mesh.expert_parallel to one of {_divisors(stage)}"
    )


def _number(mesh: Mapping[str, Any], key: str) -> int:
    """Degree `key` of a raw `mesh:` section, 1 where it is absent or not a valid degree (the schema
    refuses those)."""
    value = mesh.get(key, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def _expert_parallel_error(expert: int, stage: int) -> MeshConfigError:
    """The error of an expert_parallel that does not divide the `stage` ranks it regroups."""
    return MeshConfigError(
        f"mesh.expert_parallel={expert} must divide data_parallel_replicate × data_parallel_shard × "
        f"context_parallel × tensor_parallel = {stage}; choose one of {_divisors(stage)}"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n <= 4096 else [1, n]
