"""`Trainer`: the one place where the lower packages are wired into a training job.

build (mesh → logging → providers → model on meta → parallelize → materialize + init → optimizer,
LR schedule, data, checkpoints) → resume → train loop → checkpoint → export.
"""

import contextlib
import datetime
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from d9d.ckpt import (
    CheckpointManager,
    capture_rng_state,
    load_safetensors,
    restore_rng_state,
    save_safetensors,
)
from d9d.mesh import DistributedContext, configure_logging, get_logger
from d9d.parallel import (
    Pipeline,
    PipelineConfig,
    PipelineLayout,
    StageSpec,
    clip_grad_norm_,
    grad_norm,
    plan_pipeline,
    set_gradient_sync,
)
from d9d.trainer._fault_injection import FaultInjection
from d9d.trainer._materialize import materialize_and_initialize
from d9d.trainer.errors import TrainingError
from d9d.trainer.failures import FailureBoard, job_store
from d9d.trainer.job import ResolvedJob, resolve_job
from d9d.trainer.loading import LoadedJob, load_job_config
from d9d.trainer.metrics import ProgressLine, device_peak_flops, mfu, model_flops_per_token
from d9d.trainer.providers import (
    BuildDataProviderContext,
    BuildDatasetContext,
    InitializeModelStageContext,
    LossContext,
    ParallelizeModelStageContext,
    PrepareExportModelStageContext,
    PrepareImportModelStageContext,
)
from d9d.trainer.run_lock import RunLock
from d9d.trainer.watchdog import REPORT_GRACE_S, StepWatchdog

__all__ = ["METRICS_FILE", "TrainResult", "Trainer", "TrainingError"]

#: Per-step metrics of a run, one JSON object per line, in `save_dir/run.name/`.
METRICS_FILE = "metrics.jsonl"
#: The process-group timeout once steps run is step_s plus this: the step watchdog acts first.
_COLLECTIVE_BACKSTOP_S = 2 * REPORT_GRACE_S + 5.0

_log = get_logger("d9d.trainer")


@dataclass(frozen=True)
class TrainResult:
    """What `Trainer.train()` did."""

    start_step: int
    final_step: int
    losses: list[float]


class Trainer:
    """Runs one job: build everything from a config, train, checkpoint, export.

    trainer = Trainer.from_config("config.yaml", overrides=["trainer.schedule.total_steps=400"])
    with trainer:
        trainer.train()
        trainer.export()
    """

    def __init__(self, job: ResolvedJob) -> None:
        self._job = job
        config = job.config
        tcfg = config.trainer
        self._context = DistributedContext.from_env(
            config.mesh,
            init_timeout=_seconds(tcfg.timeouts.init_s),
            step_timeout=_seconds(tcfg.timeouts.step_s + _COLLECTIVE_BACKSTOP_S),
        )
        try:
            logging_options = {"format": tcfg.logging.format, "level": tcfg.logging.level}
            configure_logging(self._context, **logging_options)
            self._build()
            if tcfg.logging.log_dir is not None:  # only once the job is sound: a failed start writes nothing
                configure_logging(self._context, log_dir=tcfg.logging.log_dir, **logging_options)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(
        cls, source: str | Path | dict[str, Any] | LoadedJob, overrides: Sequence[str] = ()
    ) -> "Trainer":
        """Load, validate and resolve a job config (raising `ConfigError` before anything starts), then build."""
        loaded = source if isinstance(source, LoadedJob) else load_job_config(source, overrides)
        return cls(resolve_job(loaded))

    # ------------------------------------------------------------------ build

    def _build(self) -> None:
        job, ctx = self._job, self._context
        config = job.config
        dataset = (
            job.dataset_provider.build_dataset(BuildDatasetContext(context=ctx, base_dir=job.loaded.base_dir))
            if job.dataset_provider is not None
            else None
        )
        self._data = job.data_factory.build_data_provider(
            BuildDataProviderContext(context=ctx, dataset=dataset)
        )
        self._pipeline: Pipeline | None = None
        self._pp_group = None
        stage = None
        layout = None
        if config.mesh.pipeline_parallel > 1:
            layout, stage = self._plan_pipeline()
        with torch.device("meta"):
            result = job.model_provider.initialize_model_stage(
                InitializeModelStageContext(
                    context=ctx,
                    stage_index=stage.index if stage is not None else 0,
                    num_stages=layout.num_stages if layout is not None else 1,
                    stage=stage,
                    base_dir=job.loaded.base_dir,
                )
            )
        model = result.model
        if not ctx.is_local:
            job.model_provider.parallelize_model_stage(
                ParallelizeModelStageContext(
                    context=ctx,
                    model=model,
                    stage_index=stage.index if stage is not None else 0,
                    num_stages=layout.num_stages if layout is not None else 1,
                    stage=stage,
                    base_dir=job.loaded.base_dir,
                )
            )
        materialize_and_initialize(model, ctx.device, config.trainer.determinism.seed)
        self._model = model
        if layout is not None:
            self._pp_group = ctx.mesh("dense")["pp"]
            self._pipeline = Pipeline(
                layout,
                [model],
                pp_group=self._pp_group,
                n_microbatches=self._n_microbatches,
                loss_fn=self._pipeline_loss,
                device=ctx.device,
            )
        self._optimizer = job.optimizer_provider.build_optimizer(model.named_parameters())
        self._scheduler = job.lr_scheduler_provider.build_lr_scheduler(
            self._optimizer, config.trainer.schedule.total_steps
        )
        ckpt = config.trainer.checkpointing
        self._checkpoints = CheckpointManager(
            ckpt.save_dir,
            config.trainer.run.name,
            num_to_keep=ckpt.num_to_keep,
            async_save=ckpt.async_save,
            context=ctx,
        )
        self._step = 0
        self._global_weight = 1.0
        self._dp_group = None if ctx.is_local else ctx.mesh("batch").get_group("dp")
        # Fault handling: one job per run directory, one report per failure, no silent hang.
        store = job_store(ctx)
        self._failures = FailureBoard(store, ctx.rank, ctx.world_size)
        self._lock = RunLock.acquire(self.run_dir, ctx)
        if ctx.is_main_process:  # no other job writes the run now: what crashed saves left can go
            self._checkpoints.remove_leftovers()
        self._watchdog = (
            StepWatchdog(store, self._failures, ctx.rank, ctx.world_size, config.trainer.timeouts.step_s)
            if store is not None
            else None
        )
        self._faults = FaultInjection.from_env(ctx.rank)
        n_params = sum(p.numel() for p in model.parameters())
        _log.info(
            "job built",
            run=config.trainer.run.name,
            mesh=config.mesh.describe_degrees(),
            local_params=n_params,
            device=str(ctx.device),
        )

    def _plan_pipeline(self) -> tuple[PipelineLayout, StageSpec]:
        """This rank's pipeline stage (the trainer runs one stage per rank for now)."""
        job, ctx = self._job, self._context
        pcfg = job.config.pipelining
        config = PipelineConfig(pcfg.schedule, pcfg.stages_per_rank)
        if config.info.multi_stage:
            raise TrainingError(
                f"pipelining.schedule {pcfg.schedule!r} runs several stages per rank, which the trainer does "
                "not support yet (a checkpoint holds one model per rank); use gpipe or 1f1b"
            )
        count = getattr(job.model_provider, "pipeline_num_layers", None)
        if count is None:
            raise TrainingError(
                "mesh.pipeline_parallel > 1 needs a model provider with pipeline_num_layers() and stage "
                "support in initialize_model_stage (context.stage); see docs/parallelism.md"
            )
        task = job.task
        if not (hasattr(task, "pipeline_inputs") and hasattr(task, "pipeline_loss")):
            raise TrainingError(
                "mesh.pipeline_parallel > 1 needs a task with pipeline_inputs() and pipeline_loss()"
            )
        n = getattr(self._data, "microbatches_per_step", None)
        if n is None:
            raise TrainingError("mesh.pipeline_parallel > 1 needs a data provider with microbatches_per_step")
        self._n_microbatches = int(n)
        layout = plan_pipeline(
            int(count()),
            ctx.axis_size("pp"),
            config,
            embedding_weight=pcfg.embedding_weight,
            head_weight=pcfg.head_weight,
            n_microbatches=self._n_microbatches,
        )
        (stage,) = layout.stages_of_rank(ctx.coordinate("pp"))
        _log.info(
            "pipeline stage", stage=stage.index, layers=f"{stage.layers.start}..{stage.layers.stop - 1}"
        )
        return layout, stage

    def _pipeline_loss(self, output: Any, target: Any) -> torch.Tensor:
        result = self._job.task.pipeline_loss(output, target)  # type: ignore[attr-defined]
        return result.loss_sum / self._global_weight

    # ------------------------------------------------------------------ accessors

    @property
    def context(self) -> DistributedContext:
        """This rank's distributed context."""
        return self._context

    @property
    def model(self) -> torch.nn.Module:
        """The (parallelized) model."""
        return self._model

    @property
    def step(self) -> int:
        """Optimizer steps done so far (including those of resumed checkpoints)."""
        return self._step

    @property
    def run_dir(self) -> Path:
        """`save_dir/run.name`: checkpoints and the metrics file."""
        return self._checkpoints.run_dir

    # ------------------------------------------------------------------ resume

    def resume(self, step: int | None = None) -> bool:
        """Load the latest (or the given step's) committed checkpoint of this run. True when one was loaded.

        A run without a checkpoint starts from the model provider's import folder when it names one
        (`prepare_import_model_stage`, e.g. a Hugging Face checkpoint to fine-tune).

        Raises:
            TrainingError: `step` is given but the run has no committed checkpoint of that step.
        """
        self._checkpoints.check_uncommitted()
        found = self._checkpoints.checkpoints()
        if step is not None:
            matching = [c for c in found if c.step == step]
            if not matching:
                steps = [c.step for c in found]
                raise TrainingError(
                    f"run {self.run_dir} has no committed checkpoint of step {step}; it has {steps}"
                )
            found = matching
        latest = found[-1] if found else None
        if latest is None:
            self._import_source_weights()
            return False
        loaded = self._checkpoints.load(latest, self._model, self._optimizer)
        extra = loaded.extra_state
        self._step = int(extra["step"])
        self._data.load_state_dict(extra["data"])
        self._scheduler.load_state_dict(extra["lr_scheduler"])
        if loaded.rank_state is not None:
            restore_rng_state(loaded.rank_state)
        _log.info("resumed", step=self._step, checkpoint=str(latest.path))
        return True

    def _import_source_weights(self) -> None:
        prepare = getattr(self._job.model_provider, "prepare_import_model_stage", None)
        if prepare is None:
            return
        result = prepare(
            PrepareImportModelStageContext(
                context=self._context, model=self._model, base_dir=self._job.loaded.base_dir
            )
        )
        if result.folder is None:
            return
        load_safetensors(self._model, result.folder, mapper=result.mapper)
        _log.info("loaded starting weights", folder=str(result.folder))

    # ------------------------------------------------------------------ train

    def train(self) -> TrainResult:
        """Resume if the run has a checkpoint, then train until `trainer.schedule.total_steps`."""
        cfg = self._job.config.trainer
        total = cfg.schedule.total_steps
        self.resume()
        start = self._step
        losses: list[float] = []
        if start >= total:
            _log.info("run is already complete", step=start, total_steps=total)
            return TrainResult(start_step=start, final_step=start, losses=losses)
        self._context.use_step_timeout()
        metrics_path = self.run_dir / METRICS_FILE
        if self._context.is_main_process:  # steps after the checkpoint were lost with the crash: redo them
            _truncate_metrics(metrics_path, start)
        launch = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        data_iter = iter(self._data)
        last_log = time.perf_counter()
        tokens_since_log = 0.0
        progress = (
            ProgressLine(total, start) if self._context.is_main_process and cfg.logging.progress_bar else None
        )
        peak = device_peak_flops(self._context.device)
        flops_per_token: float | None = None
        try:
            while self._step < total:
                step_start = time.perf_counter()
                with self._watching(self._step + 1):
                    microbatches = next(data_iter)
                    self._faults.before_step(self._step + 1)
                    if flops_per_token is None and microbatches and isinstance(microbatches[0], dict):
                        ids = microbatches[0].get("input_ids")
                        if ids is not None:
                            flops_per_token = model_flops_per_token(self._model, int(ids.shape[-1]))
                    lr = self._scheduler.get_last_lr()[0]  # the learning rate this step uses
                    loss, norm, weight, applied = self._train_step(microbatches)
                self._step += 1
                losses.append(loss)
                tokens_since_log += weight
                record = {
                    "step": self._step,
                    "loss": loss,
                    "grad_norm": norm,
                    "lr": lr,
                    "tokens": weight,
                    "step_time_s": time.perf_counter() - step_start,
                    "skipped": not applied,
                    "launch": launch,
                }
                if self._context.is_main_process:
                    _append_jsonl(metrics_path, record)
                    if progress is not None:
                        progress.update(self._step, loss)
                    if self._step % cfg.logging.period_steps == 0 or self._step == total:
                        now = time.perf_counter()
                        tokens_per_s = tokens_since_log / max(now - last_log, 1e-9)
                        _log.info(
                            "step",
                            step=self._step,
                            loss=round(loss, 5),
                            grad_norm=round(norm, 4),
                            lr=record["lr"],
                            tokens_per_s=round(tokens_per_s, 1),
                            **mfu(tokens_per_s, flops_per_token, peak, self._context.world_size),
                            **_memory(self._context.device),
                        )
                        last_log, tokens_since_log = now, 0.0
                period = cfg.checkpointing.period_steps
                if self._step == total or (period and self._step % period == 0):
                    self.save_checkpoint()
            self._checkpoints.wait()
        except Exception as exc:
            if self._watchdog is not None:
                self._watchdog.hold_if_exiting()
            stop = self._failures.stopping(exc, self._step + 1)
            if stop is exc:
                raise
            raise stop from exc
        if progress is not None:
            progress.close()
        return TrainResult(start_step=start, final_step=self._step, losses=losses)

    def _watching(self, step: int) -> contextlib.AbstractContextManager[None]:
        return self._watchdog.step(step) if self._watchdog is not None else contextlib.nullcontext()

    def _train_step(self, microbatches: list[Any]) -> tuple[float, float, float, bool]:
        task, model, ctx = self._job.task, self._model, self._context
        local_weight = sum(task.batch_weight(mb) for mb in microbatches)
        weight = self._dp_sum(torch.tensor(float(local_weight), dtype=torch.float64)).item()
        if weight <= 0:
            raise TrainingError(f"step {self._step + 1} has no labelled tokens in the whole global batch")
        model.train()
        self._optimizer.zero_grad(set_to_none=True)
        if self._pipeline is not None:
            self._global_weight = weight
            pairs = [task.pipeline_inputs(mb) for mb in microbatches]  # type: ignore[attr-defined]
            inputs = [x.to(ctx.device) for x, _ in pairs]
            targets = [y.to(ctx.device) for _, y in pairs]
            share = self._pipeline.step(inputs, targets, broadcast_loss=True)
            assert share is not None
            loss = self._dp_sum(share.detach().to("cpu", torch.float64)).item()
        else:
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, batch in enumerate(microbatches):
                set_gradient_sync(model, i == len(microbatches) - 1)
                result = task.compute_loss(LossContext(model=model, batch=batch, device=ctx.device))
                (result.loss_sum / weight).backward()
                loss_sum += result.loss_sum.detach().to("cpu", torch.float64)
            set_gradient_sync(model, True)
            loss = self._dp_sum(loss_sum).item() / weight
        max_norm = self._job.config.trainer.gradient_clipping.max_norm
        params = [p for p in model.parameters() if p.grad is not None]
        pp = self._pp_group
        norm = (
            clip_grad_norm_(params, max_norm, pp_group=pp)
            if max_norm is not None
            else grad_norm(params, pp_group=pp)
        ).item()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            if self._job.config.trainer.on_nonfinite == "stop":
                raise TrainingError(
                    f"step {self._step + 1}: loss {loss} / grad norm {norm} is not finite; stopping. "
                    "The last committed checkpoint stays the latest; lower the learning rate or set "
                    "trainer.on_nonfinite: skip"
                )
            _log.warning("skipping step with a non-finite loss or grad norm", step=self._step + 1, loss=loss)
            self._optimizer.zero_grad(set_to_none=True)
            self._scheduler.step()
            return loss, norm, weight, False
        self._optimizer.step()
        self._scheduler.step()
        return loss, norm, weight, True

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None or dist.get_world_size(self._dp_group) == 1:
            return value
        value = value.to(torch.float64)
        dist.all_reduce(value, group=self._dp_group)
        return value

    # ------------------------------------------------------------------ checkpoint and export

    def save_checkpoint(self) -> None:
        """Save model, optimizer, data position, LR schedule, RNG and config as `save-<step>`."""
        extra = {
            "step": self._step,
            "data": self._data.state_dict(),
            "lr_scheduler": _plain(self._scheduler.state_dict()),
            "config": self._job.loaded.raw,
            "config_dir": str(self._job.loaded.base_dir.resolve()),
        }
        self._checkpoints.save(
            self._step, self._model, self._optimizer, extra_state=extra, rank_state=capture_rng_state()
        )
        _log.info("checkpoint saved", step=self._step, run_dir=str(self.run_dir))

    def export(self, out_dir: str | Path | None = None) -> Path:
        """Write the model as safetensors through the model provider's export mapper."""
        target = out_dir if out_dir is not None else self._job.config.export.dir
        if self._pipeline is not None:
            raise TrainingError(
                "export from a pipeline-parallel run is not supported yet: export the run's checkpoint "
                "from a mesh without pipeline_parallel (e.g. `d9d export` in one process)"
            )
        if target is None:
            raise TrainingError("no export directory: pass one or set export.dir in the config")
        result = self._job.model_provider.prepare_export_model_stage(
            PrepareExportModelStageContext(
                context=self._context, model=self._model, base_dir=self._job.loaded.base_dir
            )
        )
        save_safetensors(
            self._model,
            target,
            mapper=result.mapper,
            max_shard_size=self._job.config.export.shard_size_mb * 2**20,
        )
        if self._context.is_main_process:
            for name, text in result.extra_files.items():
                path = Path(target) / name
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(text, encoding="utf-8")
                tmp.replace(path)
        self._context.barrier()
        _log.info("exported", dir=str(target), files=sorted(result.extra_files))
        return Path(target)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Finish a pending checkpoint, then release the process group and the run lock."""
        try:
            watchdog = getattr(self, "_watchdog", None)
            if watchdog is not None:
                watchdog.close()
            checkpoints = getattr(self, "_checkpoints", None)
            if checkpoints is not None:
                checkpoints.close()
            data = getattr(self, "_data", None)
            if data is not None and hasattr(data, "close"):
                data.close()
        finally:
            self._context.close()  # also breaks the collectives that other ranks wait in
            failures = getattr(self, "_failures", None)
            if failures is not None:
                failures.linger()
            lock = getattr(self, "_lock", None)
            if lock is not None:
                lock.release()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def _plain(state: Any) -> Any:
    """Round-trip through msgspec so only plain data (no tensors or callables) is checkpointed."""
    return msgspec.json.decode(msgspec.json.encode(state, enc_hook=lambda o: None))


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after `step` (they were trained after the checkpoint and are redone)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if line and json.loads(line)["step"] <= step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)


def _memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30, 2)}
    except ImportError:  # pragma: no cover - not on POSIX
        return {}
