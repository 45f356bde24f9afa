"""Pipeline schedules by name: which torch schedule runs, how many stages each rank needs, how they map to ranks.

Everything here is pure: no process group is needed to check a configuration, so a job fails at
start (not in its first step) when its schedule, stage count and microbatch count do not fit. No
torch either (a schedule's torch class is looked up when it runs), so a config is checked without it.
"""

from dataclasses import dataclass
from typing import Literal

from d9d.parallel.pipeline.errors import PipelineError

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineConfig",
    "PipelineScheduleInfo",
    "StageToRankStyle",
    "check_pipeline_microbatches",
    "pipeline_schedule_info",
]

StageToRankStyle = Literal["loop", "v"]


@dataclass(frozen=True)
class PipelineScheduleInfo:
    """What d9d knows about one schedule.

    Attributes:
        name: the name used in configs.
        torch_class_name: the name of the `torch.distributed.pipelining` schedule class that runs it
            (`torch_class`).
        multi_stage: whether the torch class takes a list of stages per rank (else exactly one).
        style: how stages map to ranks: "loop" (stage s on rank s % pp) or "v" (down, then back up).
        min_stages_per_rank: fewest stages a rank may hold.
        max_stages_per_rank: most stages a rank may hold (None: no limit).
        default_stages_per_rank: used when the config leaves `stages_per_rank` unset.
        zero_bubble: splits backward into input- and weight-gradient parts run at different times.
    """

    name: str
    torch_class_name: str
    multi_stage: bool
    style: StageToRankStyle
    min_stages_per_rank: int
    max_stages_per_rank: int | None
    default_stages_per_rank: int
    zero_bubble: bool

    @property
    def torch_class(self) -> type:
        """The `torch.distributed.pipelining` schedule class that runs it."""
        from torch.distributed import pipelining

        cls: type = getattr(pipelining, self.torch_class_name)
        return cls


PIPELINE_SCHEDULES: dict[str, PipelineScheduleInfo] = {
    info.name: info
    for info in (
        PipelineScheduleInfo("gpipe", "ScheduleGPipe", False, "loop", 1, 1, 1, False),
        PipelineScheduleInfo("1f1b", "Schedule1F1B", False, "loop", 1, 1, 1, False),
        PipelineScheduleInfo("interleaved_1f1b", "ScheduleInterleaved1F1B", True, "loop", 1, None, 2, False),
        PipelineScheduleInfo("looped_bfs", "ScheduleLoopedBFS", True, "loop", 1, None, 2, False),
        PipelineScheduleInfo(
            "interleaved_zero_bubble", "ScheduleInterleavedZeroBubble", True, "loop", 1, None, 2, True
        ),
        PipelineScheduleInfo("zbv", "ScheduleZBVZeroBubble", True, "v", 2, 2, 2, True),
        PipelineScheduleInfo("dualpipev", "ScheduleDualPipeV", True, "v", 2, 2, 2, True),
    )
}


def pipeline_schedule_info(name: str) -> PipelineScheduleInfo:
    """The entry of `PIPELINE_SCHEDULES` for `name`, or a `PipelineError` listing the known names."""
    try:
        return PIPELINE_SCHEDULES[name]
    except KeyError:
        raise PipelineError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(PIPELINE_SCHEDULES)}"
        ) from None


@dataclass(frozen=True)
class PipelineConfig:
    """Which schedule runs the pipeline and how many stages each pipeline rank holds.

    Attributes:
        schedule: one of `PIPELINE_SCHEDULES` (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
            interleaved_zero_bubble, zbv, dualpipev).
        stages_per_rank: virtual stages per pipeline rank; None takes the schedule's default (1 for
            gpipe and 1f1b, 2 for the others).
    """

    schedule: str = "1f1b"
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        info = pipeline_schedule_info(self.schedule)
        n = self.resolved_stages_per_rank
        if not isinstance(n, int) or n < 1:
            raise PipelineError(f"pipeline stages_per_rank must be a positive integer, got {n!r}")
        too_few = n < info.min_stages_per_rank
        too_many = info.max_stages_per_rank is not None and n > info.max_stages_per_rank
        if too_few or too_many:
            if info.min_stages_per_rank == info.max_stages_per_rank:
                need = f"exactly {info.min_stages_per_rank}"
            else:
                need = f"at least {info.min_stages_per_rank}"
            raise PipelineError(
                f"pipeline schedule {self.schedule!r} needs {need} stage(s) per rank, got "
                f"stages_per_rank={n}; set stages_per_rank to {info.default_stages_per_rank} "
                "(or leave it unset for the schedule's default)"
            )

    @property
    def info(self) -> PipelineScheduleInfo:
        """The schedule's `PipelineScheduleInfo`."""
        return PIPELINE_SCHEDULES[self.schedule]

    @property
    def resolved_stages_per_rank(self) -> int:
        """`stages_per_rank`, or the schedule's default when unset."""
        if self.stages_per_rank is None:
            return PIPELINE_SCHEDULES[self.schedule].default_stages_per_rank
        return self.stages_per_rank


def check_pipeline_microbatches(config: PipelineConfig, pp_size: int, n_microbatches: int) -> None:
    """Refuse a microbatch count the schedule cannot run on `pp_size` ranks (torch would fail in step 1).

    Raises:
        PipelineError: naming the schedule, the counts and what would work.
    """
    if n_microbatches < 1:
        raise PipelineError(f"a pipeline step needs at least one microbatch, got {n_microbatches}")
    num_stages = pp_size * config.resolved_stages_per_rank
    name = config.schedule
    if name in ("1f1b", "dualpipev") and n_microbatches < num_stages:
        raise PipelineError(
            f"pipeline schedule {name!r} needs at least as many microbatches per step as stages: "
            f"{n_microbatches} microbatches < {num_stages} stages; give each pipeline rank at least "
            f"{num_stages} microbatches (e.g. a smaller microbatch size) or use 'gpipe'"
        )
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds != 0:
            raise PipelineError(
                f"pipeline schedule {name!r} on {pp_size} pipeline ranks needs a microbatch count "
                f"divisible by max(1, microbatches // {pp_size}) = {rounds}, got {n_microbatches}; "
                f"use a multiple of {pp_size} microbatches"
            )
