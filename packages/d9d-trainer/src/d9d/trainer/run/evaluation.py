"""The validation loop (`eval:`): the mean token loss and perplexity over a held-out set, on any mesh.

The eval set (`providers.eval_dataset`) is cut in index order, never shuffled, into microbatches of
`eval.microbatch_size` samples (the last one may hold fewer); `eval.steps` keeps the first K of them.
Global microbatch `i` goes to data-parallel rank `i mod dp` and is split over the context-parallel
ranks exactly like a training microbatch (`ContextParallel.shard_batch`). Every rank runs the same
number of forwards: a rank with one microbatch fewer repeats its first one and discards the result,
since FSDP gathers and expert dispatch are collectives of every forward. Summed token losses and
token counts stay on the device, are all-reduced over dp × cp once, and are read once (the eval's one
host sync); so the numbers depend on the weights and the eval set only, not on the mesh.

Under pipeline parallelism the microbatches run forward only through the stages
(`PipelineStep.forward_only`, any schedule), in rounds of a training step's microbatch count; the
rank with the last stage holds the sums, broadcast over the pipeline ranks after the dp × cp
all-reduce. (A stage that receives reads each microbatch's small shape header: one more host sync
per microbatch there.)

An eval runs after every `eval.period_steps`-th step and after the last one, before that step's
records are flushed and its checkpoint is saved, so a committed step always has its eval recorded and
a resumed run never repeats it.
"""

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from d9d.mesh import DistributedContext
from d9d.parallel import check_sequence_length, precision_autocast
from d9d.trainer.config.job import EvalConfig
from d9d.trainer.errors import ConfigError, TrainingError
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.planning.job_plan import EVAL_LENGTH
from d9d.trainer.providers.data import BuildDatasetContext
from d9d.trainer.providers.task import (
    LossContext,
    LossResult,
    Task,
    metric_names,
    metric_sums,
    summarize_metrics,
)
from d9d.trainer.results import EvalResult
from d9d.trainer.step.base import StepSettings
from d9d.trainer.step.pipeline import PipelineStep

__all__ = ["EvalSet", "Evaluator", "data_microbatch_size", "eval_microbatches", "load_eval_set"]


def eval_microbatches(
    num_samples: int, microbatch_size: int, steps: int | None, dp_size: int, dp_rank: int
) -> tuple[list[range], int]:
    """This rank's eval microbatches (sample index ranges, in order) and the forwards every rank runs.

    The set is cut into `ceil(num_samples / microbatch_size)` microbatches (the first `steps` of them
    when given); microbatch `i` belongs to dp rank `i mod dp_size`. The forward count is the largest
    share, the same on every rank.
    """
    total = math.ceil(num_samples / microbatch_size)
    if steps is not None:
        total = min(total, steps)
    mine = [
        range(i * microbatch_size, min((i + 1) * microbatch_size, num_samples))
        for i in range(dp_rank, total, dp_size)
    ]
    return mine, math.ceil(total / dp_size)


@dataclass(frozen=True)
class EvalSet:
    """The validation set as this rank sees it: the dataset, its collate function and its share."""

    config: EvalConfig
    dataset: Any
    collate_fn: Any
    microbatches: list[range]
    forwards: int

    def batch(self, samples: range) -> Any:
        """The collated microbatch of the samples at `samples`."""
        return self.collate_fn([self.dataset[i] for i in samples])


def load_eval_set(job: ResolvedJob, ctx: DistributedContext) -> EvalSet | None:
    """Build the `eval_dataset` and this rank's share of it (None without an `eval:` section).

    Called while the job is built, before anything is written, so a set that cannot be evaluated on
    this mesh fails first.

    Raises:
        ConfigError: the set is not sized, or holds fewer samples than one eval microbatch per
            data-parallel rank.
        SequenceLengthError: context parallelism cannot cut its sequences (`BuildDatasetResult.seq_len`).
    """
    config = job.config
    if config.eval is None or job.eval_dataset_provider is None:
        return None
    built = job.eval_dataset_provider.build_dataset(
        BuildDatasetContext(context=ctx, base_dir=job.loaded.base_dir)
    )
    dataset = built.dataset
    spec = config.providers.eval_dataset
    try:
        num_samples = len(dataset)
    except TypeError:
        raise ConfigError(
            f"providers.eval_dataset ({spec}) built a {type(dataset).__name__} without len(); the eval set "
            "must be a map-style dataset (len and integer indexing)"
        ) from None
    microbatch_size = config.eval.microbatch_size or _data_microbatch_size(config.data)
    dp_size = ctx.axis_size("dp")
    if num_samples < dp_size * microbatch_size:
        key = (
            "eval.microbatch_size"
            if config.eval.microbatch_size
            else "eval.microbatch_size (default: data.microbatch_size)"
        )
        raise ConfigError(
            f"eval_dataset: the eval set has {num_samples} sample{'s' if num_samples != 1 else ''}, fewer than one eval microbatch per "
            f"data-parallel rank ({key}={microbatch_size} × {dp_size} ranks = {dp_size * microbatch_size}); "
            f"lower eval.microbatch_size to at most {max(1, num_samples // dp_size)} or use a larger eval set"
        )
    if built.seq_len is not None:
        subject, fix = EVAL_LENGTH  # the words `d9d plan` refuses it with
        check_sequence_length(built.seq_len, config.mesh.context_parallel, subject=subject, fix=fix)
    mine, forwards = eval_microbatches(
        num_samples, microbatch_size, config.eval.steps, dp_size, ctx.coordinate("dp")
    )
    return EvalSet(config.eval, dataset, built.collate_fn or default_collate, mine, forwards)


def _data_microbatch_size(data: dict[str, Any]) -> int:
    value = data.get("microbatch_size", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def data_microbatch_size(job: ResolvedJob) -> int:
    """`data.microbatch_size` of the job (1 when its data provider's section has none)."""
    return _data_microbatch_size(job.config.data)


class Evaluator:
    """Runs the eval when it is due (see the module docstring); does nothing without an eval set."""

    def __init__(
        self,
        eval_set: EvalSet | None,
        model: nn.Module,
        task: Task,
        settings: StepSettings,
        pipeline: PipelineStep | None = None,
        *,
        context: DistributedContext | None = None,
        microbatch_size: int = 1,
    ) -> None:
        """`pipeline`: under pipeline parallelism, the training step, whose stages the eval runs
        forward only (`PipelineStep.forward_only`); `model` then holds this rank's stages.
        `context` and `microbatch_size`: where this rank sits and the microbatch of a pass over another
        dataset (`over`)."""
        self._context = context
        self._microbatch_size = microbatch_size
        self._set = eval_set
        self._pipeline = pipeline
        self._model = model
        self._task = task
        self._settings = settings

    def due(self, step: int, total_steps: int, *, stopping: bool = False) -> bool:
        """After the last step, and every `period_steps` unless the run is stopping (a signal)."""
        if self._set is None:
            return False
        period = self._set.config.period_steps
        return step == total_steps or (not stopping and period > 0 and step % period == 0)

    def after_step(self, step: int, total_steps: int, *, stopping: bool = False) -> EvalResult | None:
        """The eval of step `step` when it is due, else None."""
        if not self.due(step, total_steps, stopping=stopping):
            return None
        return self.run(step)

    def over(self, dataset: Any, collate_fn: Any) -> EvalResult:
        """The same forward-only pass over all of another map-style `dataset` (e.g. a task's pass over
        its training set before the first step: `PrepareRunContext.forward_only`), in microbatches of
        `data.microbatch_size` over the data-parallel ranks; the eval set is left as it is."""
        ctx, size = self._context, self._microbatch_size
        dp_size, dp_rank = (ctx.axis_size("dp"), ctx.coordinate("dp")) if ctx is not None else (1, 0)
        mine, forwards = eval_microbatches(len(dataset), size, None, dp_size, dp_rank)
        whole = EvalSet(EvalConfig(), dataset, collate_fn or default_collate, mine, forwards)
        kept, self._set = self._set, whole
        try:
            return self.run(0)
        finally:
            self._set = kept

    def run(self, step: int) -> EvalResult:
        """Evaluate now (model in eval mode, no grad), whatever the period says."""
        if self._set is None:
            raise TrainingError(
                "this job has no eval: section; add eval: {period_steps: N} and providers.eval_dataset"
            )
        began = time.perf_counter()
        model, settings = self._model, self._settings
        eval_set = self._set
        mine = eval_set.microbatches
        # a rank short of one microbatch repeats its first (discarded): every rank runs as many forwards;
        # one with none (fewer eval microbatches than dp ranks) runs the set's first sample, discarded
        filler = mine[0] if mine else range(0, 1)
        plan = [(samples, True) for samples in mine] + [(filler, False)] * (eval_set.forwards - len(mine))
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), settings.attention_kernels():
                if self._pipeline is None:
                    totals = self._sums(plan)
                else:
                    totals = self._pipeline_sums(plan, self._pipeline)
        finally:
            model.train(was_training)
        group = settings.dp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        if self._pipeline is not None:  # the sums are the last stage's: every pipeline rank reports them
            totals = self._pipeline.from_last_stage(totals)
        total_loss, total_tokens, *sums = totals.tolist()  # the eval's one host sync
        mean = total_loss / total_tokens if total_tokens > 0 else math.nan
        return EvalResult(
            step=step,
            loss=mean,
            perplexity=_exp(mean),
            tokens=total_tokens,
            wall_s=time.perf_counter() - began,
            metrics=summarize_metrics(self._task, sums, total_tokens) if sums else {},
        )

    def _sums(self, plan: list[tuple[range, bool]]) -> torch.Tensor:
        """[summed token loss, tokens, the task's summed metrics...] of the counted microbatches of
        `plan` (float64, on the device)."""
        settings, eval_set = self._settings, self._set
        assert eval_set is not None
        sums = self._zeros()
        for samples, counted in plan:
            batch = settings.local_batch(eval_set.batch(samples))
            with precision_autocast(settings.precision, settings.device):
                result = self._task.compute_loss(
                    LossContext(model=self._model, batch=batch, device=settings.device)
                )
            if counted:
                sums += self._row(result)
        return sums

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(
            2 + len(metric_names(self._task)), dtype=torch.float64, device=self._settings.device
        )

    def _row(self, result: LossResult) -> torch.Tensor:
        """[loss_sum, weight, the task's metric sums...] of one microbatch, float64 on the device."""
        device = self._settings.device
        metrics = metric_sums(metric_names(self._task), result, device)
        return torch.cat([_pair(result, device), metrics])

    def _pipeline_sums(self, plan: list[tuple[range, bool]], pipeline: PipelineStep) -> torch.Tensor:
        """`_sums` through the pipeline, forward only, in rounds of a training step's microbatch count
        (as many activations in flight as a step); zeros on ranks without the last stage."""
        settings, eval_set = self._settings, self._set
        assert eval_set is not None
        sums = self._zeros()
        per_round = pipeline.pipeline.n_microbatches
        for start in range(0, len(plan), per_round):
            part = plan[start : start + per_round]
            batches = [settings.local_batch(eval_set.batch(samples)) for samples, _ in part]
            with precision_autocast(settings.precision, settings.device):
                results = pipeline.forward_only(batches)
            for result, (_, counted) in zip(results or [], part, strict=False):
                if counted:
                    sums += self._row(result)
        return sums


def _pair(result: LossResult, device: torch.device) -> torch.Tensor:
    """[loss_sum, weight] of one microbatch, float64 on `device`."""
    weight = torch.as_tensor(result.weight, dtype=torch.float64).to(device)
    return torch.stack([result.loss_sum.detach().to(torch.float64), weight])


def _exp(value: float) -> float:
    try:
        return math.exp(value)
    except OverflowError:
        return math.inf
