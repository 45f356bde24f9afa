"""Which layers each pipeline stage holds and which pipeline rank runs each stage (pure arithmetic).

A model is cut into `num_stages` contiguous stages: the embedding always belongs to the first stage,
the final norm and LM head to the last, and the transformer layers are split so that the heaviest
stage is as light as possible, counting the embedding and the head as layers of a configurable
weight. With several stages per rank (interleaved and V schedules), the stages are mapped to ranks
round-robin ("loop") or down-and-back ("v").
"""

from dataclasses import dataclass

from d9d.parallel.pipeline.config import PipelineConfig, StageToRankStyle, check_pipeline_microbatches
from d9d.parallel.pipeline.errors import PipelineError

__all__ = ["PipelineLayout", "StageSpec", "plan_pipeline", "split_layers", "stage_to_rank"]

_EPS = 1e-9


def split_layers(
    num_layers: int,
    num_stages: int,
    *,
    embedding_weight: float = 1.0,
    head_weight: float = 1.0,
) -> tuple[range, ...]:
    """Split layers 0..num_layers-1 into `num_stages` contiguous ranges, balancing the stage weights.

    A stage weighs its layer count, plus `embedding_weight` on the first stage and `head_weight` on
    the last. The split minimizes the heaviest stage, then the sum of squared stage weights; of
    equally good splits it gives the extra layers to later stages (earlier stages keep more
    microbatches' activations alive under 1F1B-style schedules). A middle stage holds at least one
    layer; the first (last) stage may hold none when the embedding (head) weighs more than zero.

    Raises:
        PipelineError: when there are too few layers for the stages, or a weight is negative.
    """
    if num_stages < 1:
        raise PipelineError(f"a pipeline needs at least one stage, got num_stages={num_stages}")
    if num_layers < 0:
        raise PipelineError(f"num_layers must be >= 0, got {num_layers}")
    if embedding_weight < 0 or head_weight < 0:
        raise PipelineError(
            f"embedding_weight and head_weight must be >= 0, got {embedding_weight} and {head_weight}"
        )
    if num_stages == 1:
        return (range(num_layers),)
    last = num_stages - 1

    def extra(stage: int) -> float:
        return (embedding_weight if stage == 0 else 0.0) + (head_weight if stage == last else 0.0)

    def min_layers(stage: int) -> int:
        return 0 if extra(stage) > 0 else 1

    needed = sum(min_layers(s) for s in range(num_stages))
    if needed > num_layers:
        raise PipelineError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages: every stage without "
            f"the embedding or the head needs a layer ({needed} layers needed); use fewer stages "
            "(pipeline_parallel × stages_per_rank) or a deeper model"
        )
    inf = float("inf")
    # Suffix tables over (stage, first layer of the stage): the lightest possible heaviest stage,
    # then (with that bound) the least sum of squared stage weights.
    worst = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    worst[num_stages][num_layers] = 0.0
    for s in range(last, -1, -1):
        for i in range(num_layers + 1):
            for j in range(i + min_layers(s), num_layers + 1):
                rest = worst[s + 1][j]
                if rest < inf:
                    worst[s][i] = min(worst[s][i], max(j - i + extra(s), rest))
    bound = worst[0][0] + _EPS
    squares = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    squares[num_stages][num_layers] = 0.0
    for s in range(last, -1, -1):
        for i in range(num_layers + 1):
            for j in range(i + min_layers(s), num_layers + 1):
                weight = j - i + extra(s)
                if weight <= bound and squares[s + 1][j] < inf:
                    squares[s][i] = min(squares[s][i], weight * weight + squares[s + 1][j])
    # Walk forward taking the shortest stage that still completes an optimal split.
    ranges, start = [], 0
    for s in range(num_stages):
        for j in range(start + min_layers(s), num_layers + 1):
            weight = j - start + extra(s)
            rest = squares[s + 1][j]
            if weight <= bound and rest < inf and abs(weight * weight + rest - squares[s][start]) < 1e-6:
                ranges.append(range(start, j))
                start = j
                break
    return tuple(ranges)


def stage_to_rank(num_stages: int, pp_size: int, style: StageToRankStyle = "loop") -> tuple[int, ...]:
    """The pipeline rank of each stage: "loop" puts stage s on rank s % pp_size; "v" runs down the
    ranks and back up (stage s and stage 2·pp_size-1-s share a rank), as the V schedules need.

    Raises:
        PipelineError: if `num_stages` is not a multiple of `pp_size` (or not 2·pp_size for "v").
    """
    if pp_size < 1 or num_stages < 1 or num_stages % pp_size != 0:
        raise PipelineError(
            f"{num_stages} pipeline stages cannot be spread evenly over {pp_size} pipeline ranks"
        )
    if style == "loop":
        return tuple(s % pp_size for s in range(num_stages))
    if style == "v":
        if num_stages != 2 * pp_size:
            raise PipelineError(
                f"a V-shaped pipeline needs exactly 2 stages per rank: {num_stages} stages on {pp_size} ranks"
            )
        return tuple(s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages))
    raise PipelineError(f"unknown stage-to-rank style {style!r}; use 'loop' or 'v'")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: what a model provider needs to build it.

    Attributes:
        index: the stage's position in the pipeline, 0-based.
        num_stages: stages in the whole pipeline.
        rank: the pipeline rank (coordinate on the `pp` axis) that runs it.
        layers: indices of the transformer layers it holds (numbered as in the whole model).
    """

    index: int
    num_stages: int
    rank: int
    layers: range

    @property
    def is_first(self) -> bool:
        """Holds the embedding and receives the model's inputs (token ids)."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """Holds the final norm and the head, and feeds the loss."""
        return self.index == self.num_stages - 1


@dataclass(frozen=True)
class PipelineLayout:
    """The stages of a pipelined model, which rank runs each, and the schedule they run under."""

    config: PipelineConfig
    pp_size: int
    stages: tuple[StageSpec, ...]

    @property
    def num_stages(self) -> int:
        """Stages in the whole pipeline (pp_size × stages per rank)."""
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        """Stages each pipeline rank holds."""
        return self.num_stages // self.pp_size

    def stages_of_rank(self, pp_rank: int) -> tuple[StageSpec, ...]:
        """The stages pipeline rank `pp_rank` builds and runs, in increasing stage index."""
        if not 0 <= pp_rank < self.pp_size:
            raise PipelineError(f"pipeline rank {pp_rank} is outside 0..{self.pp_size - 1}")
        return tuple(s for s in self.stages if s.rank == pp_rank)

    def describe(self) -> str:
        """One line per stage: index, rank, layers (for logs)."""
        lines = [f"pipeline {self.config.schedule}: {self.num_stages} stages on {self.pp_size} ranks"]
        for s in self.stages:
            parts = ["embedding"] if s.is_first else []
            if len(s.layers):
                parts.append(f"layers {s.layers.start}..{s.layers.stop - 1}")
            if s.is_last:
                parts.append("head")
            lines.append(f"  stage {s.index} on pp rank {s.rank}: {', '.join(parts)}")
        return "\n".join(lines)


def plan_pipeline(
    num_layers: int,
    pp_size: int,
    config: PipelineConfig | None = None,
    *,
    embedding_weight: float = 1.0,
    head_weight: float = 1.0,
    n_microbatches: int | None = None,
) -> PipelineLayout:
    """Assign layers to stages and stages to pipeline ranks for `config`'s schedule.

    Args:
        num_layers: transformer layers of the whole model.
        pp_size: pipeline ranks (the mesh's `pp` axis size).
        config: the schedule and stages per rank (default: 1f1b, one stage per rank).
        embedding_weight: cost of the embedding, in layers (see `split_layers`).
        head_weight: cost of the final norm + head + loss, in layers.
        n_microbatches: microbatches per step on each pipeline rank; checked against the schedule
            when given.

    Raises:
        PipelineError: when the schedule, stage count, layer count or microbatch count do not fit.
    """
    config = config or PipelineConfig()
    if pp_size < 1:
        raise PipelineError(f"pp_size must be >= 1, got {pp_size}")
    num_stages = pp_size * config.resolved_stages_per_rank
    ranges = split_layers(num_layers, num_stages, embedding_weight=embedding_weight, head_weight=head_weight)
    ranks = stage_to_rank(num_stages, pp_size, config.info.style)
    if n_microbatches is not None:
        check_pipeline_microbatches(config, pp_size, n_microbatches)
    stages = tuple(
        StageSpec(index=i, num_stages=num_stages, rank=ranks[i], layers=ranges[i]) for i in range(num_stages)
    )
    return PipelineLayout(config=config, pp_size=pp_size, stages=stages)
