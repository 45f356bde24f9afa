"""A task's preparation of the run (`PreparesRun`): once the weights are in place after every resume,
with the job's datasets and a forward-only pass over any of them on the job's mesh."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from d9d.mesh import DistributedContext
from d9d.trainer.providers.data import BuildDatasetResult
from d9d.trainer.providers.task import PrepareRunContext, PreparesRun
from d9d.trainer.run.evaluation import EvalSet, Evaluator

__all__ = ["task_run_preparation"]


def task_run_preparation(
    task: object,
    *,
    run_dir: Path,
    model: nn.Module,
    context: DistributedContext,
    dataset: BuildDatasetResult | None,
    eval_set: EvalSet | None,
    evaluator: Evaluator,
) -> Callable[[bool], None] | None:
    """`restored → task.prepare_run(...)` for a task that declares `PreparesRun` (None otherwise): the
    training set (`dataset`) and the eval set by role, and the evaluator's machinery (`Evaluator.over`)
    as the forward-only pass over the whole of either."""
    if not isinstance(task, PreparesRun):
        return None
    sets: dict[str, tuple[Any, Any]] = {}
    if dataset is not None:
        sets["train"] = (dataset.dataset, dataset.collate_fn)
    if eval_set is not None:
        sets["eval"] = (eval_set.dataset, eval_set.collate_fn)

    def forward_only(role: str) -> None:
        whole, collate_fn = sets[role]
        evaluator.over(whole, collate_fn)

    def prepare(restored: bool) -> None:
        task.prepare_run(
            PrepareRunContext(
                run_dir=run_dir,
                model=model,
                context=context,
                datasets={role: whole for role, (whole, _) in sets.items()},
                restored=restored,
                forward_only=forward_only,
            )
        )

    return prepare
