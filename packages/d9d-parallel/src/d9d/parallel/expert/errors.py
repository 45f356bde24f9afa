"""Exception type of expert parallelism: bad MoE configuration or expert-parallel layout."""

from d9d.parallel.errors import ParallelizeError

__all__ = ["ExpertParallelError"]


class ExpertParallelError(ParallelizeError):
    """An MoE layer or its expert-parallel layout is misconfigured (e.g. experts not divisible by ep)."""
