"""`Trainer`: the one place where the lower packages are wired into a training job.

build (mesh → logging → dataset → plan → data provider, eval set → model: meta → parallelize →
materialize → optimizer, LR schedule, checkpoints, step strategy) → resume → loop (step → eval →
records → checkpoint) → export. Each concern lives in its own module: `planning` (what the job
builds, decided once), `build` (the model), `step/` (one optimizer step), `records` (metrics file,
log line, progress), `evaluation` (the validation loop), `starting_weights` (the import folder, a
LoRA run's base), `run_checkpoints` (save, resume), `export`; this file only wires them.
"""

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from d9d.ckpt import CheckpointInfo, CheckpointManager, KeepBest
from d9d.data import DeclaresStepsLeft
from d9d.mesh import DistributedContext, configure_logging, get_logger, rank_tag
from d9d.parallel import (
    ContextParallel,
    context_parallel_of,
    enable_tf32,
    fsdp_parameters,
    select_float8_linears,
)
from d9d.parallel.pipeline import merge_stage_modules
from d9d.trainer.build.export import Exporter
from d9d.trainer.build.model import materialize_model, shape_model
from d9d.trainer.build.starting_weights import StartingWeights
from d9d.trainer.callbacks import Callback, Callbacks, RunControl
from d9d.trainer.config import StragglersConfig
from d9d.trainer.errors import TrainingError, is_out_of_memory, step_out_of_memory
from d9d.trainer.faults.failures import FailureBoard, job_store
from d9d.trainer.faults.injection import FaultInjection
from d9d.trainer.faults.run_lock import RunLock
from d9d.trainer.faults.watchdog import REPORT_GRACE_S, StepWatchdog
from d9d.trainer.job.load import LoadedJob, load_job_config
from d9d.trainer.job.resolve import ResolvedJob, resolve_job
from d9d.trainer.observe.metrics_file import METRICS_FILE, truncate_metrics
from d9d.trainer.observe.profiling import StepProfiler
from d9d.trainer.observe.records import StepRecords
from d9d.trainer.observe.stragglers import BusyClock, StragglerWatch
from d9d.trainer.observe.throughput import ProgressLine, batch_flops_per_token, device_peak_flops
from d9d.trainer.observe.timing import StepTimer, read_phases
from d9d.trainer.observe.tracking import Trackers, check_trackers, open_trackers
from d9d.trainer.planning.job_plan import check_model_mesh, plan_job
from d9d.trainer.planning.plan import JobPlan
from d9d.trainer.providers.data import BuildDataProviderContext, BuildDatasetContext, SupportsClose
from d9d.trainer.providers.declared import undeclared_methods
from d9d.trainer.providers.model import DescribesModel
from d9d.trainer.providers.task import PipelineTask
from d9d.trainer.results import EvalResult, TrainResult
from d9d.trainer.run.checkpoints import RunCheckpoints
from d9d.trainer.run.early_stopping import EarlyStopping
from d9d.trainer.run.evaluation import EvalSet, Evaluator, load_eval_set
from d9d.trainer.run.signals import StopRequests
from d9d.trainer.step.base import StepSettings, TrainStep, token_group
from d9d.trainer.step.microbatches import MicrobatchStep
from d9d.trainer.step.pipeline import PipelineStep

__all__ = ["TrainResult", "Trainer"]

#: The process-group timeout once steps run is step_s plus this: the step watchdog acts first.
_COLLECTIVE_BACKSTOP_S = 2 * REPORT_GRACE_S + 5.0

_log = get_logger("d9d.trainer")


class Trainer:
    """Runs one job: build everything from a config, train, checkpoint, export.

    trainer = Trainer.from_config("config.yaml", overrides=["trainer.schedule.total_steps=400"])
    with trainer:
        trainer.train()
        trainer.export()
    """

    def __init__(
        self, job: ResolvedJob, *, read_only: bool = False, callbacks: Sequence[Callback] = ()
    ) -> None:
        """`read_only`: for resume-and-export while another job may train the run (`d9d export`): no run
        lock, no clean-up in the run directory; `train()` and `save_checkpoint()` refuse.
        `callbacks`: run after the config's `trainer.callbacks` (see `d9d.trainer.Callback`)."""
        self._job = job
        self._read_only = read_only
        # What close() releases, registered as the build acquires it (a failed build releases what it
        # got): `_closers` before the process group closes (the last acquired first), `_releasers` after.
        self._closers: list[Callable[[], None]] = []
        self._dataset: Any = None
        self._releasers: list[Callable[[], None]] = []
        tcfg = job.config.trainer
        self._context = DistributedContext.from_env(
            job.config.mesh,
            init_timeout=_seconds(tcfg.timeouts.init_s),
            step_timeout=_seconds(tcfg.timeouts.step_s + _COLLECTIVE_BACKSTOP_S),
            device=tcfg.device,
        )
        self._threads = _fit_cpu_threads(self._context.device)
        self._callbacks = Callbacks(
            [*job.callbacks, *callbacks], is_main_process=self._context.is_main_process
        )
        # `trainer.logging.log_dir`, (dir, logging options) until the job started (`_start_log_file`)
        self._log_file: tuple[Path, dict[str, Any]] | None = None
        self._step_done_here = False  # a step of `train()` done by this launch
        try:
            logging_options: dict[str, Any] = {"format": tcfg.logging.format, "level": tcfg.logging.level}
            configure_logging(self._context, **logging_options)
            self._build()
            log_dir = job.loaded.paths.log_dir
            if log_dir is not None:
                self._log_file = (log_dir, logging_options)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(
        cls,
        source: str | Path | dict[str, Any] | LoadedJob,
        overrides: Sequence[str] = (),
        *,
        read_only: bool = False,
        callbacks: Sequence[Callback] = (),
    ) -> "Trainer":
        """Load, validate and resolve a job config (raising `ConfigError` before anything starts), then build."""
        loaded = source if isinstance(source, LoadedJob) else load_job_config(source, overrides)
        return cls(resolve_job(loaded), read_only=read_only, callbacks=callbacks)

    # ------------------------------------------------------------------ build

    def _build(self) -> None:
        """Plan, then build what the plan says: data, eval set, model, optimizer, checkpoints, step."""
        job, ctx = self._job, self._context
        tcfg = job.config.trainer
        check_model_mesh(job)  # before any data, model or file
        if not self._read_only:
            check_trackers(tcfg.tracking)  # a missing tracker library, before any file
        dataset = (
            job.dataset_provider.build_dataset(BuildDatasetContext(context=ctx, base_dir=job.loaded.base_dir))
            if job.dataset_provider is not None
            else None
        )
        self._dataset = dataset
        plan = self._plan = plan_job(
            job, ctx, dataset=dataset
        )  # every decision, checked before data or model
        self._data = job.data_factory.build_data_provider(
            BuildDataProviderContext(context=ctx, dataset=dataset)
        )
        if isinstance(self._data, SupportsClose) and not undeclared_methods(self._data, SupportsClose):
            self._closers.append(self._data.close)
        eval_set = load_eval_set(job, ctx)  # None without eval:; a set too small fails before any write
        if ctx.device.type == "cuda":
            enable_tf32(tcfg.precision.tf32)
        chunks = self._build_model(plan)
        model = self._model = merge_stage_modules(
            chunks
        )  # several stages here: one module, whole-model names
        self._optimizer = job.optimizer_provider.build_optimizer(model.named_parameters())
        self._scheduler = job.lr_scheduler_provider.build_lr_scheduler(
            self._optimizer, tcfg.schedule.total_steps
        )
        ckpt = tcfg.checkpointing
        best = ckpt.keep_best
        checkpoints = CheckpointManager(
            job.loaded.paths.run_dir.parent,
            tcfg.run.name,
            num_to_keep=ckpt.num_to_keep,
            keep_best=KeepBest(best.metric, best.mode, best.count) if best is not None else None,
            async_save=ckpt.async_save,
            verify_on_load=ckpt.verify_on_load,
            context=ctx,
        )
        self._closers.append(checkpoints.close)  # finishes a pending asynchronous save
        starting = StartingWeights(job, ctx, model)  # one for both: one answer for the load and the check
        stopping = job.config.eval.early_stopping if job.config.eval is not None else None
        self._checkpoints = RunCheckpoints(
            job, checkpoints, model, self._optimizer, self._scheduler, self._data, starting,
            early_stopping=EarlyStopping(stopping) if stopping is not None else None,
        )  # fmt: skip
        self._exporter = Exporter(job, ctx, model, starting, pipelined=plan.pipeline is not None)
        self._build_step(plan, chunks, eval_set)
        self._step = 0
        self._guard_run(checkpoints)
        self._log_built(plan)

    def _build_model(self, plan: JobPlan) -> list[torch.nn.Module]:
        """This rank's model: one module per pipeline stage of the plan (the whole model without pp)."""
        job, ctx = self._job, self._context
        pipeline = plan.pipeline
        if pipeline is not None:
            _log.info(
                "pipeline stages",
                schedule=job.config.pipelining.schedule,
                stages=[s.index for s in pipeline.stages],
                layers=[f"{s.layers.start}..{s.layers.stop - 1}" for s in pipeline.stages],
            )
        layout = pipeline.layout if pipeline is not None else None
        return [
            materialize_model(
                job,
                ctx,
                shape_model(
                    job, ctx, plan.precision, layout=layout, stage=stage, data_vocab_size=plan.vocab_size
                ),
            )
            for stage in plan.stages
        ]

    def _build_step(self, plan: JobPlan, chunks: list[torch.nn.Module], eval_set: EvalSet | None) -> None:
        """The step strategy (microbatches, or the plan's pipeline schedule) and the evaluator."""
        job, ctx, model = self._job, self._context, self._model
        tcfg = job.config.trainer
        pipeline = plan.pipeline
        self._timer = StepTimer.for_device(ctx.device)  # the step-time breakdown, read when records flush
        self._busy = BusyClock()  # each rank's time outside collective waits, gathered in the step's sync
        self._stops = StopRequests()
        settings = StepSettings(
            device=ctx.device,
            precision=plan.precision,
            max_norm=tcfg.gradient_clipping.max_norm,
            on_nonfinite=tcfg.on_nonfinite,
            dp_group=None if ctx.is_local else token_group(ctx),
            pp_group=ctx.mesh("dense")["pp"] if pipeline is not None else None,
            stop_requested=self._stop_requested,
            save_requested=self._save_requested,
            context_parallel=context_parallel_of(model) or ContextParallel(),
            timer=self._timer,
            busy_time=None if ctx.is_local else self._busy.busy,
        )
        self._evaluator = Evaluator(eval_set, model, job.task, settings)
        self._train_step: TrainStep
        if pipeline is not None:
            task = job.task
            assert isinstance(task, PipelineTask)  # the plan refuses a pipeline without one
            self._train_step = PipelineStep(
                model,
                task,
                self._optimizer,
                self._scheduler,
                settings,
                layout=pipeline.layout,
                n_microbatches=pipeline.microbatches_per_step,
                chunks=chunks,
            )
        else:
            self._train_step = MicrobatchStep(model, job.task, self._optimizer, self._scheduler, settings)

    def _stop_requested(self) -> bool:
        """A signal or a callback of this rank asks the run to stop (read once a step)."""
        control = self._callbacks.control
        return self._stops.requested or (control is not None and control.stop_requested)

    def _save_requested(self) -> bool:
        """A callback of this rank asked for a checkpoint since the last step."""
        control = self._callbacks.control
        return control is not None and control.take_save_request()

    def _guard_run(self, checkpoints: CheckpointManager) -> None:
        """Fault handling: one job per run directory, one report per failure, no silent hang."""
        ctx, tcfg = self._context, self._job.config.trainer
        store = job_store(ctx)
        self._failures = FailureBoard(store, ctx.rank, ctx.world_size)
        self._releasers.append(self._failures.linger)
        if not self._read_only:
            self._releasers.append(RunLock.acquire(self.run_dir, ctx).release)
        if ctx.is_main_process and not self._read_only:  # no other job writes the run now: clean up
            checkpoints.remove_leftovers()
        self._watchdog = (
            StepWatchdog(
                store,
                self._failures,
                ctx.rank,
                ctx.world_size,
                tcfg.timeouts.step_s,
                dump_dir=self.run_dir / "hangs",
            )
            if store is not None
            else None
        )
        if self._watchdog is not None:
            self._closers.append(self._watchdog.close)
        self._faults = FaultInjection.from_env(ctx.rank)
        prof = tcfg.profiling
        profile_dir = self._job.loaded.paths.profile_dir if prof.active_steps else None
        self._profiler = StepProfiler(prof, profile_dir, ctx.rank, ctx.device)

    def _log_built(self, plan: JobPlan) -> None:
        ctx, config, model = self._context, self._job.config, self._model
        tcfg = config.trainer
        provider = self._job.model_provider
        described = dict(provider.describe_model()) if isinstance(provider, DescribesModel) else {}
        params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
        local_params = sum(_local_numel(p) for p in model.parameters())
        optional: dict[str, Any] = {  # only what says more than the fields before it
            "local_params": local_params if local_params != params else None,
            "device_name": ctx.device_name if ctx.device_name != str(ctx.device) else None,
            "cpu_threads": self._threads if ctx.device.type == "cpu" else None,
            "activation_checkpointing": (
                tcfg.activation_checkpointing.mode if tcfg.activation_checkpointing.mode != "none" else None
            ),
            "compile": True if tcfg.compile.enabled else None,
            "cpu_offload": _offload_note(model, ctx.device) if tcfg.memory.cpu_offload else None,
            "float8": (
                select_float8_linears(model, tcfg.precision.float8).describe()
                if tcfg.precision.float8 is not None
                else None
            ),
        }
        _log.info(
            "job built",
            run_dir=str(self.run_dir.resolve()),
            mesh=config.mesh.describe_degrees(),
            microbatches_per_step=plan.batching.microbatches_per_step if plan.batching is not None else None,
            params=params,
            device=str(ctx.device),
            precision=plan.precision.describe(),
            **{key: value for key, value in optional.items() if value is not None},
            **described,  # the model provider's own account (e.g. which backend built the model)
        )

    # ------------------------------------------------------------------ accessors

    @property
    def context(self) -> DistributedContext:
        """This rank's distributed context."""
        return self._context

    @property
    def plan(self) -> JobPlan:
        """What this rank built, as `d9d.trainer.planning.plan_job` decided it (`d9d plan` prints the same)."""
        return self._plan

    @property
    def model(self) -> torch.nn.Module:
        """The (parallelized) model."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The `d9d.data.Tokenizer` the job's dataset was encoded with (`BuildDatasetResult.tokenizer`),
        or None when the dataset provider names none."""
        return getattr(self._dataset, "tokenizer", None)

    @property
    def data(self) -> Any:
        """The data provider (iterate it for each step's microbatches)."""
        return self._data

    @property
    def train_step(self) -> TrainStep:
        """The step strategy: `train_step.run(microbatches, step)` is one optimizer step (no records,
        no checkpoint), e.g. for benchmarks; `train()` runs the whole loop."""
        return self._train_step

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (over this rank's float32 master parameters)."""
        return self._optimizer

    @property
    def step(self) -> int:
        """Optimizer steps done so far (including those of resumed checkpoints)."""
        return self._step

    @property
    def run_dir(self) -> Path:
        """`save_dir/run.name`: checkpoints and the metrics file."""
        return self._checkpoints.manager.run_dir

    # ------------------------------------------------------------------ lifecycle

    def resume(self, step: int | None = None) -> bool:
        """Load the latest (or the given step's) committed checkpoint of this run. True when one was loaded.

        A run without a checkpoint starts from the model provider's import folder when it names one
        (`prepare_import_model_stage`, e.g. a Hugging Face checkpoint to fine-tune).

        Raises:
            TrainingError: `step` is given but the run has no committed checkpoint of that step.
        """
        resumed = self._checkpoints.resume(step)
        if resumed is None:
            return False
        self._step = resumed
        return True

    def save_checkpoint(self) -> None:
        """Save model, optimizer, data position, LR schedule, RNG and config as `save-<step>`."""
        self._refuse_if_read_only("save a checkpoint")
        self._start_log_file()
        self._checkpoints.save(self._step)

    def _refuse_if_read_only(self, what: str) -> None:
        if self._read_only:
            raise TrainingError(f"cannot {what}: this Trainer was built read_only (no run lock)")

    def evaluate(self) -> EvalResult:
        """The eval of the `eval:` section on the current weights, now (`train()` runs it when due)."""
        self._start_log_file()
        return self._evaluator.run(self._step)

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the model as safetensors through the model provider's export mapper."""
        self._start_log_file()
        return self._exporter.export(out_dir)

    # ------------------------------------------------------------------ train

    def train(self) -> TrainResult:
        """Resume if the run has a checkpoint, then train until `trainer.schedule.total_steps`."""
        self._refuse_if_read_only("train")
        try:
            return self._train()
        except BaseException:
            if not self._step_done_here:  # the job did not start: no log file (the error is on stderr)
                self._log_file = None
            raise

    def _start_log_file(self) -> None:
        """Begin this rank's file under `trainer.logging.log_dir`, with every line logged before it.

        Once the job started, not at the end of the build: after this launch's first step (every rank
        then passed a collective with rank 0, whose trackers had opened), or at a checkpoint, eval or
        export outside `train()`, or at `close()` of a Trainer that never trained. A job that failed
        before its first step (a tracker that could not start, a damaged checkpoint, an error in step
        1) writes no log file, as it leaves no run directory.
        """
        if self._log_file is not None:
            log_dir, options = self._log_file
            self._log_file = None
            configure_logging(self._context, log_dir=log_dir, **options)

    def _train(self) -> TrainResult:
        self._step_done_here = False
        cfg = self._job.config.trainer
        total = cfg.schedule.total_steps
        self.resume()
        start = self._step
        control = RunControl(run_dir=self.run_dir, rank=self._context.rank, plan=self._plan, model=self._model,
                             is_main_process=self._context.is_main_process)  # fmt: skip
        control.step = start
        if start >= total:
            _log.info("run is already complete", step=start, total_steps=total)
            return self._ended(control, TrainResult(start_step=start, final_step=start, losses=[]))
        early = self._checkpoints.early_stopping
        if early is not None and early.exhausted:  # resumed from the save that stopped it: finished
            _log.info("run already stopped early", step=start, reason=early.reason())
            result = TrainResult(start_step=start, final_step=start, losses=[], early_stopped=early.reason())
            return self._ended(control, result)
        # Data that runs out (a mixture with exhausted: stop) ends the run after its last step.
        left = self._data.steps_left if isinstance(self._data, DeclaresStepsLeft) else None
        end = total if left is None else min(total, start + left)
        if end == start:
            _log.warning("the data is used up: no step left to train (dataset exhausted: stop)", step=start,
                         total_steps=total)  # fmt: skip
            result = TrainResult(start_step=start, final_step=start, losses=[], data_ended=True)
            return self._ended(control, result)
        self._context.use_step_timeout()
        ctx = self._context
        metrics_path = self.run_dir / METRICS_FILE
        if ctx.is_main_process:  # steps after the checkpoint were lost with the crash: redo them
            damaged = truncate_metrics(metrics_path, start)
            if damaged:  # a line cut by a crash or a full disk: never a reason to fail
                _log.warning("metrics file had damaged lines; they are dropped", file=str(metrics_path),
                             lines=damaged[:10])  # fmt: skip
        trackers = Trackers()  # opened in the loop's try: one that cannot start stops every rank, reported
        records = StepRecords(
            metrics_path,
            writer=ctx.is_main_process,
            total=total,
            first=start + 1,
            period=cfg.logging.period_steps,
            launch=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            peak_flops=device_peak_flops(ctx.device),
            world_size=ctx.world_size,
            device=ctx.device,
            progress=ProgressLine(total, start) if ctx.is_main_process and cfg.logging.progress_bar else None,
            trackers=trackers,
            on_records=self._callbacks.steps if self._callbacks else None,
            stragglers=_straggler_watch(ctx, cfg.logging.stragglers),
        )
        data_iter = iter(self._data)
        source_tokens = getattr(self._data, "source_tokens", lambda: None)  # a mixture's, per source
        period = cfg.checkpointing.period_steps
        stopped_by = None
        early_stopped = None
        began = time.perf_counter()
        flops_unknown = True
        with self._stops, self._busy.watching():
            try:
                trackers.take(
                    open_trackers(
                        self._job.loaded, self.run_dir, start_step=start, writer=ctx.is_main_process
                    )
                )
                self._callbacks.start(control)
                while self._step < end:
                    step_start = time.perf_counter()
                    self._busy.start_step()
                    # a profiled step's trace holds the timer's d9d.* ranges, its checkpoint's too
                    with self._profiler.step(self._step + 1):
                        self._timer.begin()
                        with self._watching(self._step + 1):
                            microbatches = next(data_iter)
                            self._timer.mark("data")
                            self._faults.before_step(self._step + 1)
                            if flops_unknown:  # the sequence length is known from the first batch on
                                records.flops_per_token = batch_flops_per_token(self._model, microbatches)
                                flops_unknown = False
                            lr = self._scheduler.get_last_lr()[0]  # the learning rate this step uses
                            output = self._train_step.run(microbatches, self._step + 1)
                        self._step += 1
                        if not self._step_done_here:
                            self._step_done_here = True
                            self._start_log_file()
                        step_time_s = time.perf_counter() - step_start
                        evaluation = self._evaluator.after_step(self._step, total, stopping=output.stop)
                        records.add(self._step, output, lr=lr, step_time_s=step_time_s, evaluation=evaluation,
                                    phases=self._timer.take(), source_tokens=source_tokens())  # fmt: skip
                        control.step = self._step
                        stop_early = False
                        if evaluation is not None:
                            self._checkpoints.evaluated(evaluation)  # its numbers go on the next saves
                            # the same eval numbers on every rank: every rank decides alike, here
                            stop_early = early is not None and early.observe(evaluation.loss)
                            if self._callbacks:
                                self._callbacks.evaluated(evaluation)
                        periodic = bool(period) and self._step % period == 0
                        if (
                            self._step == end
                            or periodic
                            or output.save
                            or stop_early
                            or (output.stop and cfg.checkpointing.save_on_signal)
                        ):
                            records.flush()  # a committed checkpoint never has fewer records than steps
                            self._timer.begin("checkpoint")  # its stall goes on the next step's record
                            self._committed(self._checkpoints.save(self._step))
                            self._timer.mark("checkpoint")
                        else:
                            self._committed(self._checkpoints.manager.poll())  # an async save's commit
                    if stop_early and self._step < end:
                        assert early is not None
                        early_stopped = early.reason()
                        break
                    if output.stop and self._step < end:
                        stopped_by = (
                            self._stops.signal_name
                            or control.stop_reason
                            or "a signal or a callback on another rank"
                        )
                        break
                self._committed(self._checkpoints.manager.wait())
            except Exception as caught:
                exc: Exception = caught
                if is_out_of_memory(caught):
                    snapshot = None
                    with contextlib.suppress(Exception):
                        snapshot = self._profiler.dump_snapshot()
                    exc = step_out_of_memory(caught, self._context.device, self._step + 1, snapshot)
                if self._watchdog is not None:
                    self._watchdog.hold_if_exiting()
                records.close(failed=True)  # keep what was trained before the failure; trackers end
                self._callbacks.failed(exc)
                stop = self._failures.stopping(exc, self._step + 1)
                if stop is caught:
                    raise
                if stop is exc:
                    raise exc from None
                raise stop from exc
            except BaseException as interrupted:  # Ctrl-C, SystemExit: still end the trackers' runs
                with contextlib.suppress(Exception):
                    records.close(failed=True)
                self._callbacks.failed(interrupted)
                raise
        records.close()
        unrecorded = read_phases([self._timer.take()])[0]  # the stall of the last checkpoint
        latest = self._checkpoints.manager.checkpoints()
        (_log.info if self._context.is_main_process else _log.debug)(  # one line for the job
            "run summary",
            steps=self._step - start,
            final_step=self._step,
            wall_s=round(time.perf_counter() - began, 1),
            tokens=records.tokens,
            final_loss=records.losses[-1] if records.losses else None,
            last_checkpoint=str(latest[-1].path) if latest else None,
            last_checkpoint_stall_s=round(unrecorded["time_checkpoint_s"], 3),
        )
        if stopped_by is not None:
            saved = "saved" if cfg.checkpointing.save_on_signal else "not saved (save_on_signal: false)"
            _log.warning(
                f"stopped by {stopped_by} at step {self._step}; checkpoint {saved}; resume with the same command",
                step=self._step,
            )
        if early_stopped is not None:
            _log.info(f"stopped at step {self._step} by {early_stopped}; checkpoint saved", step=self._step)
        data_ended = stopped_by is None and early_stopped is None and end < total
        if data_ended:
            _log.warning(
                f"the data is used up after step {end} of {total} (dataset exhausted: stop): the run ends here, "
                "with its checkpoint", step=end, total_steps=total,
            )  # fmt: skip
        return self._ended(control, TrainResult(
            start_step=start, final_step=self._step, losses=records.losses, stopped_by=stopped_by,
            early_stopped=early_stopped, data_ended=data_ended,
        ))  # fmt: skip

    def _committed(self, info: CheckpointInfo | None) -> None:
        """Tell the callbacks of a committed checkpoint (None: none committed now)."""
        if info is not None and self._callbacks:
            self._callbacks.committed(info.step, info.path)

    def _ended(self, control: RunControl, result: TrainResult) -> TrainResult:
        if self._callbacks:
            if self._callbacks.control is None:  # a run with nothing to train: built, then done
                self._callbacks.start(control)
            self._callbacks.ended(result)
        return result

    def _watching(self, step: int) -> contextlib.AbstractContextManager[None]:
        return self._watchdog.step(step) if self._watchdog is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Finish a pending checkpoint, then release the process group and the run lock."""
        # Each runs even when one before it raised (the first error is raised at the end). Closers go
        # last-acquired first (the watchdog, the checkpoint manager's pending save, the data provider);
        # releasers after the process group, first-acquired first: the failure board lingers for the
        # other ranks' reports, and only then is the run lock released for the next job.
        errors: list[BaseException] = []
        with contextlib.suppress(Exception):  # a Trainer that never trained (its own loop, an export)
            self._start_log_file()
        for release in [*reversed(self._closers), self._context.close, *self._releasers]:
            try:
                release()
            except BaseException as exc:  # reraised below, after the rest ran
                errors.append(exc)
        self._closers.clear()
        self._releasers.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fit_cpu_threads(device: torch.device) -> int:
    """On CPU, unless OMP_NUM_THREADS says otherwise, share this node's cores among its ranks.

    torch's default (all cores per process) oversubscribes them with several ranks or a busy machine,
    which made small CPU jobs many times slower.
    """
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        torch.set_num_threads(max(1, cores // max(1, local_world)))
    return torch.get_num_threads()


def _local_numel(param: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _straggler_watch(ctx: DistributedContext, config: StragglersConfig | None) -> StragglerWatch | None:
    """The slow-rank warning of a run of several ranks, on rank 0 (which writes the records)."""
    if config is None or ctx.is_local or not ctx.is_main_process:
        return None
    return StragglerWatch(config.ratio, config.steps, describe=lambda rank: rank_tag(ctx.config, rank))


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _offload_note(model: torch.nn.Module, device: torch.device) -> str:
    """What `trainer.memory.cpu_offload` keeps on the host, for the "job built" line."""
    host = fsdp_parameters(model, offloaded=True)
    size = sum(_local_numel(p) * p.element_size() for p in host)
    pinned = "pinned " if device.type == "cuda" else ""
    nothing = "" if device.type == "cuda" else "; a CPU run has no device to offload from"
    return f"{len(host)} parameters ({size:,} bytes on this rank), their gradients and optimizer state in {pinned}host memory{nothing}"
