"""What a run records about its steps: `metrics.jsonl`, the step log line, the progress line.

Step results arrive as device tensors. They are read (one host sync for all of them) only when the
records are flushed: at logging steps, before a checkpoint and at the end. So a crash loses at most
the records since the last log line, never those of a committed checkpoint, and an ordinary step
never waits for the device to report its loss. Rank 0 writes; every rank flushes at the same steps.

A step that ran an eval (`d9d.trainer.run.evaluation`) carries its numbers as `eval_loss`,
`eval_perplexity` and `eval_tokens` on its record, is flushed at once and logs an `eval` line.

Each record also carries its step's `tokens_per_s` (tokens / step_time_s), `mfu` where the device's
peak is known, the peak memory so far (`peak_mem_gib` on CUDA, `peak_rss_gib` on CPU; read when the
step is added, a host-side counter, no sync) and the step-time breakdown of `d9d.trainer.observe.timing`
(`time_data_s`, `time_forward_backward_s`, `time_optimizer_s`, `time_checkpoint_s`), read at flush.

On several ranks a record also names the step's busiest rank (`straggler_rank`, `straggler_time_s`,
`straggler_ratio` over the median rank: `d9d.trainer.observe.stragglers`), gathered in the step's own sync
and read with the rest; with packed rows under context parallelism, `cp_attention_balance` (the most
loaded cp rank's attention pairs over the mean, counted on the host before the step: no read); a rank that stays the busiest by `trainer.logging.stragglers.ratio` for its
`steps` gets one warning.

The experiment trackers (`d9d.trainer.observe.tracking`: TensorBoard, W&B, MLflow) get the same records,
when the file does.
"""

import contextlib
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from d9d.mesh import get_logger
from d9d.trainer.observe.stragglers import StragglerWatch, straggler_fields
from d9d.trainer.observe.throughput import ProgressLine, mfu
from d9d.trainer.observe.timing import StepPhases, read_phases
from d9d.trainer.observe.tracking import Trackers
from d9d.trainer.results import EvalResult
from d9d.trainer.step.base import StepOutput

__all__ = ["StepRecords"]

_log = get_logger("d9d.trainer")

#: A MoE model's per-step load (`StepOutput.expert_load`): the least and the most loaded expert over the
#: mean, and the coefficient of variation of tokens per expert, worst layer each.
_MOE_LOAD_FIELDS = ("moe_load_min", "moe_load_max", "moe_load_cv")


@dataclass
class _Pending:
    step: int
    output: StepOutput
    lr: float
    step_time_s: float
    evaluation: EvalResult | None = None
    phases: StepPhases | None = None
    memory: dict[str, float] | None = None
    source_tokens: dict[str, int] | None = None


def _cp_balance_field(output: StepOutput) -> dict[str, float]:
    """`cp_attention_balance` of a step over packed rows under context parallelism (a host value)."""
    balance = output.cp_attention_balance
    return {} if balance is None else {"cp_attention_balance": balance}


class StepRecords:
    """Buffers step results and writes them in batches (see the module docstring).

    Args:
        path: the run's metrics file.
        writer: this rank writes the file and the log lines (rank 0).
        total: the run's total steps (the last one is always logged).
        first: the first step of this launch (logged too, so a start shows at once).
        period: log every `period` steps.
        launch: an id of this launch, stored in every record.
        peak_flops: the device's dense bf16 peak, for MFU (None: no MFU).
        world_size: ranks sharing the throughput.
        device: the device whose peak memory is reported.
        progress: a progress line to update each step (None: none).
        trackers: experiment trackers that get every record too (`d9d.trainer.observe.tracking`; rank 0's).
        on_records: called with the records once they are written (on every rank: the callbacks'
            `on_step`).
        stragglers: warns about a rank that stays the busiest (rank 0's; None: no warning).
        summarize: the task's metrics (`StepOutput.metrics`, global sums) and the step's weight →
            the values its record holds (`d9d.trainer.providers.task.summarize_metrics`); None: none.
    """

    def __init__(
        self,
        path: Path,
        *,
        writer: bool,
        total: int,
        period: int,
        launch: str,
        first: int = 1,
        peak_flops: float | None,
        world_size: int,
        device: torch.device,
        progress: ProgressLine | None = None,
        trackers: Trackers | None = None,
        on_records: Callable[[list[dict[str, Any]]], None] | None = None,
        stragglers: StragglerWatch | None = None,
        summarize: Callable[[Sequence[float], float], dict[str, float]] | None = None,
    ) -> None:
        self._path = path
        self._writer = writer
        self._total = total
        self._first = first
        self._period = period
        self._launch = launch
        self._peak = peak_flops
        self._world_size = world_size
        self._device = device
        self._progress = progress
        self._trackers = trackers
        self._on_records = on_records
        self._stragglers = stragglers
        self._summarize = summarize
        self._last_metrics: dict[str, float] = {}  # the task's metrics of the last flushed step
        self._pending: list[_Pending] = []
        self._last_log = time.perf_counter()
        self._last_loss: float | None = None
        self._last_loss_step: int | None = None
        self.flops_per_token: float | None = None
        self.losses: list[float] = []
        self.tokens = 0.0

    def add(
        self,
        step: int,
        output: StepOutput,
        *,
        lr: float,
        step_time_s: float,
        evaluation: EvalResult | None = None,
        phases: StepPhases | None = None,
        source_tokens: Mapping[str, int] | None = None,
    ) -> None:
        """Record step `step` (and the eval that ran after it); flushes (and logs) when it is a logging
        step, the last one, or has an eval (whose host sync has happened anyway). `phases`: the step's
        unread time breakdown (plus the stall of the checkpoint before it). `source_tokens`: a
        mixture's tokens per source so far (`AutoDataProvider.source_tokens`), recorded as
        `tokens_seen/<source>`."""
        sources = dict(source_tokens) if source_tokens is not None else None
        self._pending.append(
            _Pending(step, output, lr, step_time_s, evaluation, phases, _memory(self._device), sources)
        )
        if evaluation is not None:
            self._last_log += evaluation.wall_s  # tokens/s counts training time only
        if step % self._period == 0 or step == self._total or step == self._first or evaluation is not None:
            self.flush(log=True)
        if self._progress is not None:  # after a logging step's flush: its own loss, not the one before
            self._progress.update(step, self._last_loss, self._last_loss_step)

    def flush(self, *, log: bool = False) -> None:
        """Read the pending results from the device (one sync) and append them to the metrics file."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        columns = [
            torch.stack([p.output.loss.double(), p.output.grad_norm.double(), p.output.weight.double()])
            for p in pending
        ]
        moe = all(p.output.expert_load is not None for p in pending)
        if moe:  # the MoE load of each step: three more columns of the same read
            columns = [
                torch.cat([c, p.output.expert_load.double()]) for c, p in zip(columns, pending, strict=True)
            ]  # type: ignore[union-attr]
        busy = all(p.output.rank_busy is not None for p in pending)
        if busy:  # every rank's busy time of each step: world-size more columns of the same read
            columns = [
                torch.cat([c, p.output.rank_busy.double()]) for c, p in zip(columns, pending, strict=True)
            ]  # type: ignore[union-attr]
        task_metrics = self._summarize is not None and all(p.output.metrics is not None for p in pending)
        if task_metrics:  # the task's summed metrics of each step: more columns of the same read, last
            columns = [
                torch.cat([c, p.output.metrics.double()]) for c, p in zip(columns, pending, strict=True)
            ]  # type: ignore[union-attr]
        width = len(pending[0].output.metrics) if task_metrics else 0  # type: ignore[arg-type]
        values = torch.stack(columns).tolist()
        times = read_phases([p.phases for p in pending])  # after the sync above: no wait
        records = []
        for p, (loss, norm, weight, *rest), phases in zip(pending, values, times, strict=True):
            rest, sums = (rest[: len(rest) - width], rest[len(rest) - width :]) if width else (rest, [])
            task_values = self._summarize(sums, weight) if task_metrics and self._summarize else {}
            self._last_metrics = task_values
            load, ranks = (rest[:3], rest[3:]) if moe else ([], rest)
            tokens_per_s = weight / max(p.step_time_s, 1e-9)
            records.append(
                {
                    "step": p.step,
                    "loss": loss,
                    "grad_norm": norm,
                    **task_values,
                    "lr": p.lr,
                    "tokens": weight,
                    "step_time_s": p.step_time_s,
                    "tokens_per_s": tokens_per_s,
                    **mfu(tokens_per_s, self.flops_per_token, self._peak, self._world_size),
                    **(p.memory or {}),
                    **phases,
                    **(dict(zip(_MOE_LOAD_FIELDS, load, strict=True)) if moe else {}),
                    **(straggler_fields(ranks) if busy else {}),
                    **_cp_balance_field(p.output),
                    **{f"tokens_seen/{name}": n for name, n in (p.source_tokens or {}).items()},
                    "skipped": not p.output.applied,
                    "launch": self._launch,
                    **(p.evaluation.record() if p.evaluation is not None else {}),
                }
            )
        self.losses += [r["loss"] for r in records]
        self.tokens += sum(r["tokens"] for r in records)
        self._last_loss, self._last_loss_step = records[-1]["loss"], records[-1]["step"]
        if self._writer:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._path.open("a", encoding="utf-8") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in records))
            if self._trackers is not None:
                self._trackers.log(records)
            if log:
                self._log_line(records)
            if self._stragglers is not None and busy:
                for record in records:
                    self._stragglers.observe(record)
            for p in pending:
                if p.evaluation is not None:
                    _log_eval(p.evaluation)
        if self._on_records is not None:  # after the file: a callback that raises loses no record
            self._on_records(records)

    def close(self, *, failed: bool = False) -> None:
        """Flush what is left, end the progress line and close the trackers.

        `failed`: the run stops on an error: a flush that fails too is left out (what was trained
        before stays), and the trackers end their run as failed.
        """
        try:
            if failed:
                with contextlib.suppress(Exception):
                    self.flush()
            else:
                self.flush()
            if self._progress is not None:
                self._progress.close()
        finally:
            if self._trackers is not None:
                self._trackers.close(failed=failed)

    def _log_line(self, records: list[dict[str, Any]]) -> None:
        now = time.perf_counter()
        tokens = sum(r["tokens"] for r in records)
        tokens_per_s = tokens / max(now - self._last_log, 1e-9)
        self._last_log = now
        last = records[-1]
        _log.info(
            "step",
            step=last["step"],
            loss=round(last["loss"], 5),
            grad_norm=round(last["grad_norm"], 4),
            lr=float(f"{last['lr']:.6g}"),  # the file keeps the exact value
            **{name: round(value, 5) for name, value in self._last_metrics.items()},
            tokens_per_s=round(tokens_per_s, 1),
            **mfu(tokens_per_s, self.flops_per_token, self._peak, self._world_size),
            **_memory(self._device),
        )


def _log_eval(result: EvalResult) -> None:
    _log.info(
        "eval",
        step=result.step,
        loss=round(result.loss, 5),
        perplexity=round(result.perplexity, 3),
        **{name: round(value, 5) for name, value in result.metrics.items()},
        tokens=int(result.tokens),
        wall_s=round(result.wall_s, 2),
    )


def _memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30, 2)}
    except ImportError:  # pragma: no cover - not on POSIX
        return {}
