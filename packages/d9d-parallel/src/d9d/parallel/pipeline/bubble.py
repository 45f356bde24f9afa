"""A pipeline schedule's theoretical bubble: the share of a step a pipeline rank idles (pure arithmetic)."""

from dataclasses import dataclass
from fractions import Fraction

__all__ = ["ZERO_BUBBLE_SCHEDULES", "PipelineBubble", "pipeline_bubble"]

#: Schedules that split the backward into input- and weight-gradient parts to fill the bubble.
ZERO_BUBBLE_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")

_SOURCES = {
    "gpipe": "GPipe (Huang et al. 2019)",
    "1f1b": "1F1B (PipeDream-Flush; Narayanan et al. 2021)",
    "interleaved_1f1b": "interleaved 1F1B (Narayanan et al., Megatron-LM, 2021)",
    "looped_bfs": "looped BFS (Lamy-Poirier, Breadth-First Pipeline Parallelism, 2023)",
    "interleaved_zero_bubble": "interleaved zero bubble (Qi et al., Zero Bubble Pipeline Parallelism, 2024)",
    "zbv": "ZB-V (Qi et al., Zero Bubble Pipeline Parallelism, 2024)",
    "dualpipev": "DualPipeV (DeepSeek-V3's DualPipe cut to a V, Sea AI Lab 2025)",
}


@dataclass(frozen=True)
class PipelineBubble:
    """A schedule's theoretical bubble: the share of a step's forward + backward time a pp rank idles.

    Attributes:
        fraction: idle time / step time (every rank alike); None where the formula does not apply.
        formula: the formula in p (pp ranks), v (stages per rank) and m (microbatches per step).
        source: the schedule family and where the formula comes from.
    """

    fraction: Fraction | None
    formula: str
    source: str


def pipeline_bubble(schedule: str, pp_size: int, stages_per_rank: int, n_microbatches: int) -> PipelineBubble:
    """The bubble of `schedule` on `pp_size` ranks of `stages_per_rank` stages, for m microbatches per step.

    Every stage is assumed to take the same time per microbatch (a rank's v stages each 1/v of its
    share) and communication to be free. GPipe and 1F1B fill and drain the pipeline once per pass:
    (p−1)/(m+p−1). Interleaved 1F1B and looped BFS run v stages of 1/v the time per rank, which cuts
    the fill and drain to (p−1)/v stage times: (p−1)/(v·m+p−1); with m < p the microbatches do not
    cover a round over the ranks and each of the v−1 later rounds idles another p−m stage times.
    Zero-bubble schedules split the backward into input- and weight-gradient parts and run the weight
    part where the others would leave the pipeline's fill and drain idle: ≈ 0 when forward, input
    and weight gradient take equal time and m ≥ p·v (fewer microbatches than stages leave the
    warm-up uncovered: no figure).
    """
    p, v, m = pp_size, stages_per_rank, n_microbatches
    source = _SOURCES[schedule]
    if schedule in ZERO_BUBBLE_SCHEDULES:
        if m >= p * v:
            return PipelineBubble(Fraction(0), "≈ 0 for m ≥ p·v", source)
        return PipelineBubble(None, "≈ 0 only for m ≥ p·v", source)
    if schedule in ("gpipe", "1f1b"):
        return PipelineBubble(Fraction(p - 1, m + p - 1), "(p−1)/(m+p−1)", source)
    if m >= p:
        return PipelineBubble(Fraction(p - 1, v * m + p - 1), "(p−1)/(v·m+p−1)", source)
    idle = (p - 1) + (v - 1) * (p - m)
    return PipelineBubble(
        Fraction(idle, v * m + idle), "((p−1)+(v−1)(p−m))/(v·m+(p−1)+(v−1)(p−m)) for m < p", source
    )
