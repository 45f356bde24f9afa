"""`Trainer`: the one place where the lower packages are wired into a training job.

build (mesh → logging → dataset → plan → data provider, eval set → model: meta → parallelize →
materialize → optimizer, LR schedule, checkpoints, step strategy, fault guards) → `train()`: the run
loop (`run/loop.py`: resume, then data → step → records → eval → save → stop) → export. Each concern
lives in its room: `planning/` (what the job builds, decided once), `build/` (the model, its starting
weights, export), `step/` (one optimizer step), `run/` (the loop, evaluation, checkpoints),
`observe/` (records, trackers, timing), `faults/`; this file only wires them.
"""

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from d9d.ckpt import CheckpointManager, KeepBest, StreamDestination
from d9d.mesh import DistributedContext, configure_logging, get_logger
from d9d.parallel import (
    ContextParallel,
    TrainingStateSleep,
    context_parallel_of,
    enable_tf32,
)
from d9d.parallel.pipeline import merge_stage_modules
from d9d.trainer.build.export import Exporter
from d9d.trainer.build.model import materialize_model, shape_model
from d9d.trainer.build.starting_weights import StartingWeights
from d9d.trainer.callbacks import Callback, Callbacks
from d9d.trainer.errors import TrainingError
from d9d.trainer.faults.guards import RunGuards, guard_run
from d9d.trainer.faults.watchdog import REPORT_GRACE_S
from d9d.trainer.job.load import LoadedJob, load_job_config
from d9d.trainer.job.resolve import ResolvedJob, resolve_job
from d9d.trainer.observe.built import log_job_built
from d9d.trainer.observe.profiling import StepProfiler
from d9d.trainer.observe.stragglers import BusyClock
from d9d.trainer.observe.timing import StepTimer
from d9d.trainer.observe.tracking import check_trackers
from d9d.trainer.planning.job_plan import check_model_mesh, plan_job
from d9d.trainer.planning.plan import JobPlan
from d9d.trainer.providers.data import BuildDataProviderContext, BuildDatasetContext, SupportsClose
from d9d.trainer.providers.declared import undeclared_methods
from d9d.trainer.providers.task import PipelineTask
from d9d.trainer.results import EvalResult, TrainResult
from d9d.trainer.run.checkpoints import RunCheckpoints
from d9d.trainer.run.early_stopping import EarlyStopping
from d9d.trainer.run.evaluation import EvalSet, Evaluator, data_microbatch_size, load_eval_set
from d9d.trainer.run.loop import RunLoop, RunParts
from d9d.trainer.run.signals import StopRequests
from d9d.trainer.run.task_run import task_run_preparation
from d9d.trainer.run.tokenizer import RunTokenizer
from d9d.trainer.step.base import StepSettings, TrainStep, token_group
from d9d.trainer.step.microbatches import MicrobatchStep
from d9d.trainer.step.pipeline import PipelineStep
from d9d.trainer.step.randomness import TrainingRandomness

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
        """Plan, then build what the plan says: data, eval set, model, optimizer, checkpoints, step,
        the fault guards and the run loop."""
        job, ctx = self._job, self._context
        check_model_mesh(job)  # before any data, model or file
        if not self._read_only:
            check_trackers(job.config.trainer.tracking)  # a missing tracker library, before any file
        dataset = self._dataset = (
            job.dataset_provider.build_dataset(BuildDatasetContext(context=ctx, base_dir=job.loaded.base_dir))
            if job.dataset_provider is not None
            else None
        )
        plan = self._plan = plan_job(
            job, ctx, dataset=dataset
        )  # every decision, checked before data or model
        self._data = job.data_factory.build_data_provider(
            BuildDataProviderContext(context=ctx, dataset=dataset)
        )
        if isinstance(self._data, SupportsClose) and not undeclared_methods(self._data, SupportsClose):
            self._closers.append(self._data.close)
        eval_set = load_eval_set(job, ctx)  # None without eval:; a set too small fails before any write
        chunks = self._build_model(plan)
        self._model = merge_stage_modules(chunks)  # several stages here: one module, whole-model names
        self._optimizer = job.optimizer_provider.build_optimizer(self._model.named_parameters())
        self._sleep = TrainingStateSleep(self._model, self._optimizer)
        self._scheduler = job.lr_scheduler_provider.build_lr_scheduler(
            self._optimizer, job.config.trainer.schedule.total_steps
        )
        manager = self._build_checkpoints(plan)
        self._build_step(plan, chunks, eval_set)
        guards = guard_run(ctx, job.config.trainer.timeouts, self.run_dir, manager, read_only=self._read_only,
                           closers=self._closers, releasers=self._releasers)  # fmt: skip
        prof = job.config.trainer.profiling
        profiler = StepProfiler(prof, job.loaded.paths.profile_dir if prof.active_steps else None, ctx.rank,
                                ctx.device)  # fmt: skip
        self._loop = RunLoop(job, ctx, plan, self._run_parts(guards, profiler), run_dir=self.run_dir,
                             on_first_step=self._start_log_file)  # fmt: skip
        log_job_built(job, ctx, plan, self._model, cpu_threads=self._threads, run_dir=self.run_dir)

    def _build_checkpoints(self, plan: JobPlan) -> CheckpointManager:
        """The run's checkpoint manager, its save and resume (`RunCheckpoints`) and the exporter."""
        job, ctx, model = self._job, self._context, self._model
        ckpt = job.config.trainer.checkpointing
        best = ckpt.keep_best
        manager = CheckpointManager(
            job.loaded.paths.run_dir.parent,
            job.config.trainer.run.name,
            num_to_keep=ckpt.num_to_keep,
            keep_best=KeepBest(best.metric, best.mode, best.count) if best is not None else None,
            async_save=ckpt.async_save,
            verify_on_load=ckpt.verify_on_load,
            context=ctx,
        )
        self._closers.append(manager.close)  # finishes a pending asynchronous save
        starting = StartingWeights(job, ctx, model)  # one for both: one answer for the load and the check
        stopping = job.config.eval.early_stopping if job.config.eval is not None else None
        dataset_tokenizer = self._dataset.tokenizer if self._dataset is not None else None
        tokenizer = self._tokenizer = RunTokenizer(
            manager.run_dir, dataset_tokenizer, read_only=self._read_only, is_main_process=ctx.is_main_process
        )
        self._checkpoints = RunCheckpoints(
            job, manager, model, self._optimizer, self._scheduler, self._data, starting,
            early_stopping=EarlyStopping(stopping) if stopping is not None else None, tokenizer=tokenizer,
            task=job.task,
        )  # fmt: skip
        self._exporter = Exporter(job, ctx, model, starting, pipelined=plan.pipeline is not None,
                                  tokenizer_files=tokenizer.files)  # fmt: skip
        return manager

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
        if ctx.device.type == "cuda":
            enable_tf32(job.config.trainer.precision.tf32)
        layout = pipeline.layout if pipeline is not None else None
        return [
            materialize_model(
                job,
                ctx,
                shape_model(
                    job,
                    ctx,
                    plan.precision,
                    layout=layout,
                    stage=stage,
                    data_vocab_size=plan.vocab_size,
                    attention=plan.attention,
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
        self._randomness = TrainingRandomness.of(ctx, tcfg.determinism.seed)
        settings = StepSettings(
            device=ctx.device,
            precision=plan.precision,
            max_norm=tcfg.gradient_clipping.max_norm,
            on_nonfinite=tcfg.on_nonfinite,
            dp_group=None if ctx.is_local else token_group(ctx),
            pp_group=ctx.mesh("dense")["pp"] if pipeline is not None else None,
            stop_requested=lambda: self._stops.requested,  # a signal: stop, to resume
            finish_requested=self._callbacks.stop_requested,  # a callback: end the run, finished
            save_requested=self._callbacks.take_save_request,
            context_parallel=context_parallel_of(model) or ContextParallel(),
            timer=self._timer,
            busy_time=None if ctx.is_local else self._busy.busy,
            randomness=self._randomness,
            attention=plan.attention,
            balance_documents=tcfg.attention.balance_documents,
        )
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
        pipelined = self._train_step if isinstance(self._train_step, PipelineStep) else None
        self._evaluator = Evaluator(eval_set, model, job.task, settings, pipeline=pipelined, context=ctx,
                                    microbatch_size=data_microbatch_size(job))  # fmt: skip
        self._eval_set = eval_set

    def _run_parts(self, guards: RunGuards, profiler: StepProfiler) -> RunParts:
        return RunParts(
            model=self._model,
            data=self._data,
            train_step=self._train_step,
            evaluator=self._evaluator,
            scheduler=self._scheduler,
            checkpoints=self._checkpoints,
            callbacks=self._callbacks,
            timer=self._timer,
            busy=self._busy,
            stops=self._stops,
            profiler=profiler,
            watchdog=guards.watchdog,
            failures=guards.failures,
            faults=guards.faults,
            randomness=self._randomness,
            prepare_run=task_run_preparation(
                self._job.task,
                run_dir=self.run_dir,
                model=self._model,
                context=self._context,
                dataset=self._dataset,
                eval_set=self._eval_set,
                evaluator=self._evaluator,
            ),
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
        """The `d9d.data.Tokenizer` the run's dataset was encoded with (`BuildDatasetResult.tokenizer`);
        read back (`read_only`), the copy of its files that the run directory keeps when it has one
        (`RUN_DIR/tokenizer`, written with the first checkpoint); None when neither names one."""
        return self._tokenizer.tokenizer

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
        return self._loop.step

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
        return self._loop.resume(step)

    def save_checkpoint(self) -> None:
        """Save model, optimizer, data position, LR schedule, RNG and config as `save-<step>`."""
        self._refuse_if_read_only("save a checkpoint")
        self._refuse_if_asleep("save a checkpoint")
        self._start_log_file()
        self._checkpoints.save(self.step)

    def _refuse_if_read_only(self, what: str) -> None:
        if self._read_only:
            raise TrainingError(f"cannot {what}: this Trainer was built read_only (no run lock)")

    def _refuse_if_asleep(self, what: str) -> None:
        if self._sleep.asleep:
            raise TrainingError(f"cannot {what}: the training state is asleep: call Trainer.wake() first")

    def sleep(self) -> int:
        """Move the parameters, gradients and optimizer states to host memory (freeing the accelerator for
        an inference engine between steps); the bytes moved. See `d9d.parallel.TrainingStateSleep`."""
        return self._sleep.sleep()

    def wake(self) -> None:
        """Bring the training state back from `sleep()`: training goes on as if it had not slept."""
        self._sleep.wake()

    def evaluate(self) -> EvalResult:
        """The eval of the `eval:` section on the current weights, now (`train()` runs it when due)."""
        self._refuse_if_asleep("evaluate")
        self._start_log_file()
        return self._evaluator.run(self.step)

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the model as safetensors through the model provider's export mapper."""
        self._refuse_if_asleep("export")
        self._start_log_file()
        return self._exporter.export(out_dir)

    def stream_weights(
        self,
        dtype: torch.dtype | None = torch.bfloat16,
        bucket_bytes: int = 512 * 2**20,
        destination: StreamDestination = "rank0",
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The model's weights as `export()` would write them (Hugging Face names and shapes; a LoRA
        run's merged model), in buckets of (name, tensor) for an inference engine's weight update.

        Every rank calls it and iterates it to the end (collectives); the receiving ranks (global rank
        0, or every rank with `destination="all"`) get the tensors on the CPU, parameters cast to
        `dtype` (None: as trained), buffers in their own dtype; the others get as many empty lists.
        A bucket's bytes stay within `bucket_bytes`, a larger tensor is a bucket of its own
        (`d9d.ckpt.stream_weights`; docs/running-jobs.md, "Weight stream").
        """
        return self._exporter.stream(dtype, bucket_bytes, destination)

    # ------------------------------------------------------------------ train

    def train(self) -> TrainResult:
        """Resume if the run has a checkpoint, then train until `trainer.schedule.total_steps`."""
        self._refuse_if_read_only("train")
        self._refuse_if_asleep("train")
        try:
            return self._loop.run()
        except BaseException:
            if not self._loop.stepped:  # the job did not start: no log file (the error is on stderr)
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


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)
