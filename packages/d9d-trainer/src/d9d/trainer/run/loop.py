"""The run loop: every step goes data → step → records → eval → save decision → stop decision, each a
named phase below; `Trainer.train()` only calls `RunLoop.run()`.

Each decision belongs to the object that owns it: when to evaluate (`Evaluator.due`), when to save
(`SavePolicy`), when eval loss stopped improving (`EarlyStopping`), whether a signal asked to stop
(to resume: `StepOutput.stop`) or a callback to end the run (finished: `StepOutput.finish`, recorded
in the save as a `CallbackStop`), each agreed over every rank in the step's one sync, when the data
ends (`DeclaresStepsLeft`).

Between two steps there is one place where a training method acts without forking the trainer: the
step's microbatches come from `StepSource`, which is the data provider's next batch, or, for a task
that declares `PreparesSteps` (a post-training method: rollouts generated from the current weights
and scored, weights synced to an inference engine, another batch source), what its `prepare_step`
returns. Callbacks stay the user's hook into every phase (`d9d.trainer.callbacks`).
"""

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from d9d.data import DeclaresStepsLeft, ReportsSources
from d9d.mesh import DistributedContext, get_logger, rank_tag
from d9d.parallel import precision_autocast
from d9d.trainer.callbacks import Callbacks, RunControl
from d9d.trainer.config.trainer import StragglersConfig
from d9d.trainer.errors import is_out_of_memory, step_out_of_memory
from d9d.trainer.faults.failures import FailureBoard
from d9d.trainer.faults.injection import FaultInjection
from d9d.trainer.faults.watchdog import StepWatchdog
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.observe.metrics_file import METRICS_FILE, truncate_metrics
from d9d.trainer.observe.profiling import StepProfiler
from d9d.trainer.observe.records import StepRecords
from d9d.trainer.observe.stragglers import BusyClock, StragglerWatch
from d9d.trainer.observe.throughput import ProgressLine, batch_flops_per_token, device_peak_flops
from d9d.trainer.observe.timing import StepTimer, read_phases
from d9d.trainer.observe.tracking import Trackers, open_trackers
from d9d.trainer.planning.plan import JobPlan
from d9d.trainer.providers.task import PreparesSteps, PrepareStepContext, metric_names, summarize_metrics
from d9d.trainer.results import EvalResult, TrainResult
from d9d.trainer.run.callback_stop import CallbackStop
from d9d.trainer.run.checkpoints import RunCheckpoints
from d9d.trainer.run.evaluation import Evaluator
from d9d.trainer.run.signals import StopRequests
from d9d.trainer.step.base import StepOutput, TrainStep
from d9d.trainer.step.randomness import TrainingRandomness

__all__ = ["RunLoop", "RunParts", "StepSource"]

_log = get_logger("d9d.trainer")


@dataclass(frozen=True)
class RunParts:
    """What the loop drives, built by the Trainer (each part owns its decision, see the module docstring).

    Attributes:
        model: this rank's (parallelized) model: its stages merged into one module.
        data: the data provider.
        train_step: one optimizer step from one step's microbatches.
        evaluator: the eval of the `eval:` section, when due.
        scheduler: the learning-rate schedule (its last lr is the lr of the step about to run).
        checkpoints: save and resume of the run, with its `SavePolicy`.
        callbacks: the job's callbacks on this rank.
        timer: the step-time breakdown.
        busy: this rank's time outside collective waits (stragglers).
        stops: SIGTERM / Ctrl-C as a stop request.
        profiler: the profiled steps.
        watchdog: a hung or failed rank stops every rank (None on one process).
        failures: the failure board: one report per failure.
        faults: fault injection for d9d's own fault tests.
        randomness: this rank's random streams (the step's data draws from the one of its step).
        prepare_run: called after every resume with whether a checkpoint was loaded: the task's
            `prepare_run` (`PreparesRun`), once the weights it needs are in place; None: nothing.
    """

    model: torch.nn.Module
    data: Any
    train_step: TrainStep
    evaluator: Evaluator
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpoints: RunCheckpoints
    callbacks: Callbacks
    timer: StepTimer
    busy: BusyClock
    stops: StopRequests
    profiler: StepProfiler
    watchdog: StepWatchdog | None
    failures: FailureBoard
    faults: FaultInjection
    randomness: TrainingRandomness | None = None
    prepare_run: Callable[[bool], None] | None = None


class StepSource:
    """Where each step's microbatches come from: the data provider, or the task's `prepare_step`."""

    def __init__(self, parts: RunParts, task: Any, context: DistributedContext) -> None:
        self._data: Iterator[Any] = iter(parts.data)
        self._preparer = task if isinstance(task, PreparesSteps) else None
        self._model = parts.model
        self._context = context
        self._randomness = parts.randomness
        self._settings = getattr(parts.train_step, "settings", None)

    def _forward(self) -> contextlib.AbstractContextManager[Any]:
        """The training step's forward context: autocast to its compute dtype and its attention kernel."""
        settings = self._settings
        if settings is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(precision_autocast(settings.precision, settings.device))
        stack.enter_context(settings.attention_kernels())
        return stack

    def next(self, step: int) -> Any:
        """The microbatches of step `step` (1-based), drawn now: after step `step - 1` updated the weights,
        with the generators seeded for the step's data (`TrainingRandomness.seed_data`)."""
        if self._randomness is not None:
            self._randomness.seed_data(step)
        if self._preparer is None:
            return next(self._data)
        return self._preparer.prepare_step(
            PrepareStepContext(
                step=step, data=self._data, model=self._model, context=self._context, forward=self._forward
            )
        )


@dataclass
class _Outcome:
    """How the steps of one `run()` ended: by a signal (`preempted`), a callback's stop
    (`callback_stop`), early stopping, or none of them."""

    stopped_by: str | None = None
    preempted: bool = False
    callback_stop: CallbackStop | None = None
    early_stopped: str | None = None


class RunLoop:
    """Runs the steps of one job from its latest checkpoint to `trainer.schedule.total_steps`.

    `on_first_step` is called once this launch has done a step (the trainer then starts its log files).
    """

    def __init__(
        self,
        job: ResolvedJob,
        context: DistributedContext,
        plan: JobPlan,
        parts: RunParts,
        *,
        run_dir: Path,
        on_first_step: Callable[[], None],
    ) -> None:
        self._job = job
        self._context = context
        self._plan = plan
        self._parts = parts
        self._run_dir = run_dir
        self._on_first_step = on_first_step
        self.step = 0
        self.stepped = False  # a step done by this launch's `run()`

    # ------------------------------------------------------------------ the run

    def run(self) -> TrainResult:
        """Resume, then train until the end of the schedule, the data, or a stop; save; summarize."""
        self.stepped = False
        self.resume()
        start, control = self.step, self._control()
        end = self._last_step(start)
        finished = self._nothing_to_train(start, end)
        if finished is not None:
            return self._ended(control, finished)
        self._context.use_step_timeout()
        records, trackers = self._records(start)
        began = time.perf_counter()
        outcome = self._steps(control, records, trackers, end)
        records.close()
        data_ended = outcome.stopped_by is None and outcome.early_stopped is None and end < self._total
        self._summarize(records, start, end, began, outcome, data_ended)
        return self._ended(control, TrainResult(
            start_step=start, final_step=self.step, losses=records.losses, stopped_by=outcome.stopped_by,
            preempted=outcome.preempted, early_stopped=outcome.early_stopped, data_ended=data_ended,
        ))  # fmt: skip

    def resume(self, step: int | None = None) -> bool:
        """Load the latest (or the given step's) committed checkpoint; True when one was loaded."""
        resumed = self._parts.checkpoints.resume(step)
        if self._parts.prepare_run is not None:  # the weights are the starting ones, or the checkpoint's
            self._parts.prepare_run(resumed is not None)
        if resumed is None:
            return False
        self.step = resumed
        return True

    @property
    def _total(self) -> int:
        return self._job.config.trainer.schedule.total_steps

    def _control(self) -> RunControl:
        ctx = self._context
        control = RunControl(run_dir=self._run_dir, rank=ctx.rank, plan=self._plan, model=self._parts.model,
                             is_main_process=ctx.is_main_process)  # fmt: skip
        control.step = self.step
        return control

    def _last_step(self, start: int) -> int:
        """`total_steps`, or the last step the data holds (a mixture with `exhausted: stop`)."""
        data = self._parts.data
        left = data.steps_left if isinstance(data, DeclaresStepsLeft) else None
        return self._total if left is None else min(self._total, start + left)

    def _nothing_to_train(self, start: int, end: int) -> TrainResult | None:
        """The result of a run with no step left: complete, stopped early or by a callback, or its
        data used up."""
        if start >= self._total:
            _log.info("run is already complete", step=start, total_steps=self._total)
            return TrainResult(start_step=start, final_step=start, losses=[])
        early = self._parts.checkpoints.early_stopping
        if early is not None and early.exhausted:  # resumed from the save that stopped it: finished
            _log.info("run already stopped early", step=start, reason=early.reason())
            return TrainResult(start_step=start, final_step=start, losses=[], early_stopped=early.reason())
        stop = self._parts.checkpoints.callback_stop
        if stop is not None and stop.holds(self._parts.callbacks.names):  # resumed from the save it ended
            _log.info(f"run already stopped at step {stop.step} by {stop.describe()}; it is finished (take the "
                      "callback out of trainer.callbacks to train on)", step=start)  # fmt: skip
            return TrainResult(start_step=start, final_step=start, losses=[], stopped_by=stop.reason)
        if stop is not None:
            _log.info(f"the run stopped at step {stop.step} by {stop.describe()}, which this launch does not "
                      "have: it trains on", step=start)  # fmt: skip
        if end == start:
            _log.warning("the data is used up: no step left to train (dataset exhausted: stop)", step=start,
                         total_steps=self._total)  # fmt: skip
            return TrainResult(start_step=start, final_step=start, losses=[], data_ended=True)
        return None

    def _records(self, start: int) -> tuple[StepRecords, Trackers]:
        """The step records of this launch (the metrics lines past the checkpoint dropped first), and
        the trackers they feed, opened with the steps: one that cannot start stops every rank, reported."""
        ctx, cfg = self._context, self._job.config.trainer
        metrics_path = self._run_dir / METRICS_FILE
        if ctx.is_main_process:  # steps after the checkpoint were lost with the crash: redo them
            damaged = truncate_metrics(metrics_path, start)
            if damaged:  # a line cut by a crash or a full disk: never a reason to fail
                _log.warning("metrics file had damaged lines; they are dropped", file=str(metrics_path),
                             lines=damaged[:10])  # fmt: skip
        callbacks, trackers = self._parts.callbacks, Trackers()
        progress = (
            ProgressLine(self._total, start) if ctx.is_main_process and cfg.logging.progress_bar else None
        )
        records = StepRecords(
            metrics_path,
            writer=ctx.is_main_process,
            total=self._total,
            first=start + 1,
            period=cfg.logging.period_steps,
            launch=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            peak_flops=device_peak_flops(ctx.device),
            world_size=ctx.world_size,
            device=ctx.device,
            progress=progress,
            trackers=trackers,
            on_records=callbacks.steps if callbacks else None,
            stragglers=_straggler_watch(ctx, cfg.logging.stragglers),
            summarize=partial(summarize_metrics, self._job.task) if metric_names(self._job.task) else None,
        )
        return records, trackers

    def _steps(self, control: RunControl, records: StepRecords, trackers: Trackers, end: int) -> _Outcome:
        """The steps up to `end` (or a stop), then the last asynchronous save's commit; a failure is
        reported once for the job (`_failure`)."""
        parts, outcome = self._parts, _Outcome()
        with parts.stops, parts.busy.watching():
            try:
                trackers.take(open_trackers(self._job.loaded, self._run_dir, start_step=self.step,
                                                    writer=self._context.is_main_process))  # fmt: skip
                parts.callbacks.start(control)
                source = StepSource(parts, self._job.task, self._context)
                while self.step < end:
                    output, stop_early = self._step(source, records, control, end)
                    if self._stopped(outcome, output, stop_early, control, end):
                        break
                self._committed(parts.checkpoints.manager.wait())
            except Exception as caught:
                exc, stop = self._failure(caught, records)
                if stop is caught:
                    raise
                if stop is exc:
                    raise exc from None
                raise stop from exc
            except BaseException as interrupted:  # Ctrl-C, SystemExit: still end the trackers' runs
                with contextlib.suppress(Exception):
                    records.close(failed=True)
                parts.callbacks.failed(interrupted)
                raise
        return outcome

    # ------------------------------------------------------------------ one step, by phase

    def _step(
        self, source: StepSource, records: StepRecords, control: RunControl, end: int
    ) -> tuple[StepOutput, bool]:
        """One step through its phases; (its output, whether early stopping ends the run after it)."""
        parts, step = self._parts, self.step + 1
        began = time.perf_counter()
        parts.busy.start_step()
        # a profiled step's trace holds the timer's d9d.* ranges, its checkpoint's too
        with parts.profiler.step(step):
            parts.timer.begin()
            with self._watching(step):
                microbatches = source.next(step)  # data
                parts.timer.mark("data")
                parts.faults.before_step(step)
                if records.flops_per_token is None:  # the sequence length is known from the first batch on
                    records.flops_per_token = batch_flops_per_token(parts.model, microbatches)
                lr = parts.scheduler.optimizer.param_groups[0]["lr"]  # what this step's update uses
                output = parts.train_step.run(microbatches, step)  # step
            self.step = step
            if not self.stepped:
                self.stepped = True
                self._on_first_step()
            ending = output.stop or output.finish  # skips a periodic eval
            evaluation = parts.evaluator.after_step(step, self._total, stopping=ending)  # eval
            records.add(step, output, lr=lr, step_time_s=time.perf_counter() - began, evaluation=evaluation,
                        phases=parts.timer.take(), source_tokens=self._source_tokens())  # fmt: skip
            control.step = step
            stop_early = self._evaluated(evaluation)
            finished = (
                self._callback_stop(control) if output.finish and not stop_early and step < end else None
            )
            self._save_if_due(records, output, stop_early, end, finished)
        return output, stop_early

    def _evaluated(self, evaluation: EvalResult | None) -> bool:
        """Hand an eval to the checkpoints and callbacks; whether early stopping ends the run now."""
        if evaluation is None:
            return False
        parts = self._parts
        parts.checkpoints.evaluated(evaluation)  # its numbers go on the next saves
        early = parts.checkpoints.early_stopping
        # the same eval numbers on every rank: every rank decides alike, here
        stop_early = early is not None and early.observe(evaluation.loss)
        if parts.callbacks:
            parts.callbacks.evaluated(evaluation)
        return stop_early

    def _save_if_due(self, records: StepRecords, output: StepOutput, stop_early: bool, end: int,
                     finished: CallbackStop | None) -> None:  # fmt: skip
        """Save when the save policy says so (with `finished`, the callback's stop that ends the run
        here); else take the commit of an asynchronous save, if any."""
        checkpoints, timer = self._parts.checkpoints, self._parts.timer
        due = checkpoints.policy.due(self.step, last=self.step == end, requested=output.save,
                                     stopping=output.stop, finishing=stop_early or output.finish)  # fmt: skip
        if not due:
            self._committed(checkpoints.manager.poll())
            return
        records.flush()  # a committed checkpoint never has fewer records than steps
        timer.begin("checkpoint")  # its stall goes on the next step's record
        self._committed(checkpoints.save(self.step, finished))
        timer.mark("checkpoint")

    def _callback_stop(self, control: RunControl) -> CallbackStop:
        """The stop a callback asked for, ending the run at this step (on a rank whose callbacks did
        not ask: "a callback on another rank")."""
        reason = control.stop_reason or "a callback on another rank"
        return CallbackStop(callback=control.stop_callback, reason=reason, step=self.step)

    def _stopped(self, outcome: _Outcome, output: StepOutput, stop_early: bool, control: RunControl,
                 end: int) -> bool:  # fmt: skip
        """Whether the run stops before `end`: early stopping, a callback's stop (finished, even with
        a signal at the same step), or a signal (to resume) of any rank."""
        if self.step >= end:
            return False
        early = self._parts.checkpoints.early_stopping
        if stop_early and early is not None:
            outcome.early_stopped = early.reason()
            return True
        if output.finish:
            outcome.callback_stop = self._callback_stop(control)
            outcome.stopped_by = outcome.callback_stop.reason
            return True
        if output.stop:
            outcome.stopped_by = self._parts.stops.signal_name or "a signal on another rank"
            outcome.preempted = True
            return True
        return False

    # ------------------------------------------------------------------ around the steps

    def _failure(self, caught: Exception, records: StepRecords) -> tuple[Exception, Exception]:
        """(the error as this rank saw it, the error to stop with): the failure board's verdict, one
        report for the job."""
        parts = self._parts
        exc: Exception = caught
        if is_out_of_memory(caught):
            snapshot = None
            with contextlib.suppress(Exception):
                snapshot = parts.profiler.dump_snapshot()
            exc = step_out_of_memory(caught, self._context.device, self.step + 1, snapshot)
        if parts.watchdog is not None:
            parts.watchdog.hold_if_exiting()
        records.close(failed=True)  # keep what was trained before the failure; trackers end
        parts.callbacks.failed(exc)
        return exc, parts.failures.stopping(exc, self.step + 1)

    def _summarize(self, records: StepRecords, start: int, end: int, began: float, outcome: _Outcome,
                   data_ended: bool) -> None:  # fmt: skip
        """The run summary line, and why the run ended before `total_steps` when it did."""
        unrecorded = read_phases([self._parts.timer.take()])[0]  # the stall of the last checkpoint
        latest = self._parts.checkpoints.manager.checkpoints()
        (_log.info if self._context.is_main_process else _log.debug)(  # one line for the job
            "run summary",
            steps=self.step - start,
            final_step=self.step,
            wall_s=round(time.perf_counter() - began, 1),
            tokens=records.tokens,
            final_loss=records.losses[-1] if records.losses else None,
            last_checkpoint=str(latest[-1].path) if latest else None,
            last_checkpoint_stall_s=round(unrecorded["time_checkpoint_s"], 3),
        )
        if outcome.preempted:
            on_signal = self._job.config.trainer.checkpointing.save_on_signal
            saved = "saved" if on_signal else "not saved (save_on_signal: false)"
            _log.warning(f"stopped by {outcome.stopped_by} at step {self.step}; checkpoint {saved}; resume with "
                         "the same command", step=self.step)  # fmt: skip
        if outcome.callback_stop is not None:
            _log.info(f"stopped at step {self.step} by {outcome.callback_stop.describe()}; checkpoint saved; the "
                      "run is finished", step=self.step)  # fmt: skip
        if outcome.early_stopped is not None:
            _log.info(
                f"stopped at step {self.step} by {outcome.early_stopped}; checkpoint saved", step=self.step
            )
        if data_ended:
            _log.warning(
                f"the data is used up after step {end} of {self._total} (dataset exhausted: stop): the run "
                "ends here, with its checkpoint",
                step=end,
                total_steps=self._total,
            )

    def _source_tokens(self) -> dict[str, int] | None:
        data = self._parts.data
        return data.source_tokens() if isinstance(data, ReportsSources) else None

    def _committed(self, info: Any) -> None:
        """Tell the callbacks of a committed checkpoint (None: none committed now)."""
        if info is not None and self._parts.callbacks:
            self._parts.callbacks.committed(info.step, info.path)

    def _ended(self, control: RunControl, result: TrainResult) -> TrainResult:
        callbacks = self._parts.callbacks
        if callbacks:
            if callbacks.control is None:  # a run with nothing to train: built, then done
                callbacks.start(control)
            callbacks.ended(result)
        return result

    def _watching(self, step: int) -> contextlib.AbstractContextManager[None]:
        watchdog = self._parts.watchdog
        return watchdog.step(step) if watchdog is not None else contextlib.nullcontext()


def _straggler_watch(ctx: DistributedContext, config: StragglersConfig | None) -> StragglerWatch | None:
    """The slow-rank warning of a run of several ranks, on rank 0 (which writes the records)."""
    if config is None or ctx.is_local or not ctx.is_main_process:
        return None
    return StragglerWatch(config.ratio, config.steps, describe=lambda rank: rank_tag(ctx.config, rank))
