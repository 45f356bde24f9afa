"""A run's checkpoints as the trainer writes and reads them: what a save holds besides model and
optimizer, and what a resume restores and checks (a changed optimizer, the LR schedule as configured
now, the settings that changed). The checkpoint mechanics themselves are d9d.ckpt's.

Each save's commit record holds the numbers of the last eval at or before its step (`EVAL_METRICS`,
with that eval's step), which `keep_best` ranks by and `d9d checkpoints` shows; a resume takes them
back, so a save before the next eval records them again. The early-stopping counter rides in the
extra state, and so does, in the save of the step a callback stopped the run at, its `CallbackStop`."""

from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import nn

from d9d.ckpt import CheckpointInfo, CheckpointManager, capture_rng_state, restore_rng_state
from d9d.data import ReportsSources
from d9d.mesh import DEGREE_KEYS, get_logger
from d9d.trainer.build.starting_weights import StartingWeights
from d9d.trainer.builtins.optim import BuiltinLRSchedulerProvider
from d9d.trainer.config.job import OptimizerConfig, ProvidersConfig
from d9d.trainer.config.trainer import EVAL_METRICS, CheckpointingConfig
from d9d.trainer.errors import TrainingError
from d9d.trainer.job.resolve import ResolvedJob
from d9d.trainer.results import EvalResult
from d9d.trainer.run.callback_stop import CallbackStop
from d9d.trainer.run.early_stopping import EarlyStopping
from d9d.trainer.run.tokenizer import RunTokenizer

__all__ = ["RunCheckpoints", "SavePolicy", "config_changes", "optimizer_change"]

_log = get_logger("d9d.trainer")


@dataclass(frozen=True)
class SavePolicy:
    """When the loop saves a checkpoint after a step (`trainer.checkpointing`).

    Attributes:
        period: every `period_steps` steps (0: never periodically).
        on_signal: when a signal stops the run (`save_on_signal`).
    """

    period: int
    on_signal: bool

    @classmethod
    def of(cls, config: CheckpointingConfig) -> "SavePolicy":
        return cls(period=config.period_steps, on_signal=config.save_on_signal)

    def due(self, step: int, *, last: bool, requested: bool, stopping: bool, finishing: bool) -> bool:
        """Save after `step`: the run's last step, a periodic one, one a callback asked to save, one
        after which the run ends as finished (early stopping, a callback's stop), or one after which
        a signal stops it (with `save_on_signal`)."""
        periodic = self.period > 0 and step % self.period == 0
        return last or periodic or requested or finishing or (stopping and self.on_signal)


class RunCheckpoints:
    """Save and resume for one run; the trainer owns the step count and passes it in.

    `manager` is the run's `CheckpointManager` (its directory, pending save, committed checkpoints);
    `tokenizer`, the run's, whose files a save copies into the run directory (once).
    """

    def __init__(
        self,
        job: ResolvedJob,
        manager: CheckpointManager,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        data: Any,
        starting: StartingWeights,
        early_stopping: EarlyStopping | None = None,
        tokenizer: RunTokenizer | None = None,
        task: Any = None,
    ) -> None:
        self.manager = manager
        # a task with state of its own (`state_dict`/`load_state_dict`, plain data: e.g. a preference
        # task's reference log-probabilities) is saved in every checkpoint and restored with it
        self._task = task if callable(getattr(task, "state_dict", None)) else None
        self._tokenizer = tokenizer
        self.early_stopping = early_stopping
        #: What stopped the run, from the checkpoint it resumed from (None: no callback did).
        self.callback_stop: CallbackStop | None = None
        self.policy = SavePolicy.of(job.config.trainer.checkpointing)
        self._eval_metrics: dict[str, float] | None = None  # of the last eval, recorded by each save
        self._eval_step: int | None = None
        self._job = job
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._data = data
        self._starting = starting

    def evaluated(self, result: EvalResult) -> None:
        """The loop's latest eval: the numbers the next saves record in their commit records."""
        record = result.record()
        self._eval_metrics = {key: record[key] for key in EVAL_METRICS}
        self._eval_step = result.step

    def resume(self, step: int | None = None) -> int | None:
        """Load the latest (or the given step's) committed checkpoint; the step it holds, or None.

        A run without a checkpoint starts from the model provider's import folder when it names one.

        Raises:
            TrainingError: `step` is given but the run has no committed checkpoint of that step.
        """
        self.manager.check_uncommitted()
        found = self.manager.checkpoints()
        if step is not None:
            matching = [c for c in found if c.step == step]
            if not matching:
                steps = [c.step for c in found]
                raise TrainingError(
                    f"run {self.manager.run_dir} has no committed checkpoint of step {step}; it has {steps}"
                )
            found = matching
        latest = found[-1] if found else None
        if latest is None:
            self._starting.load()
            return None
        saved = self.manager.read_extra_state(latest)
        saved_config = saved.get("config")
        if latest.meta.trainable_only:  # a LoRA checkpoint: the frozen base comes from where it came
            self._starting.check_base(latest.path, saved.get("lora_base"))
            self._starting.load()
        changed = optimizer_change(saved_config, self._job.loaded.raw)
        reset = changed is not None
        if reset and not self._job.config.trainer.resume.reset_optimizer:
            raise TrainingError(
                f"the optimizer changed since checkpoint {latest.path} ({changed}): its state cannot be carried "
                "over; set trainer.resume.reset_optimizer=true to start the new optimizer fresh from the "
                "checkpoint's weights, or start a new run (another trainer.run.name)"
            )
        loaded = self.manager.load(latest, self._model, None if reset else self._optimizer)
        if reset:
            _log.warning("optimizer state reset: the optimizer changed since the checkpoint", change=changed)
        extra = loaded.extra_state
        self._data.load_state_dict(extra["data"])
        changes = self._data.resume_changes if isinstance(self._data, ReportsSources) else None
        if changes:  # e.g. the weights of a mixture
            _log.warning(
                "the data mixture changed since the checkpoint; its new shares apply from the next step",
                step=int(extra["step"]) + 1, shares=changes,
            )  # fmt: skip
        self._scheduler.load_state_dict(extra["lr_scheduler"])
        # One base lr per parameter group of *this* rank's optimizer: the checkpoint's scheduler state
        # came from rank 0, whose stage may have had other groups (another pipeline layout).
        self._scheduler.base_lrs = [
            group.get("initial_lr", group["lr"]) for group in self._optimizer.param_groups
        ]
        self._explain_schedule(saved_config, *_reapply_schedule(self._scheduler, self._optimizer))
        if loaded.rank_state is not None:
            restore_rng_state(loaded.rank_state)
        self._eval_metrics, self._eval_step = latest.meta.metrics, latest.meta.metrics_step
        if self.early_stopping is not None:
            self.early_stopping.load_state_dict(extra.get("early_stopping") or {})
        self.callback_stop = CallbackStop.from_state(extra.get("callback_stop"))
        if self._task is not None:
            self._task.load_state_dict(extra.get("task") or {})
        resumed = int(extra["step"])
        _log.info("resumed", step=resumed, checkpoint=str(latest.path))
        saved_world = extra.get("world")
        if isinstance(saved_world, dict) and saved_world != self._world():  # e.g. an elastic restart
            _log.info("resumed on another world", step=resumed, checkpoint_world=saved_world.get("size"),
                      checkpoint_mesh=saved_world.get("mesh"), world=self._world()["size"],
                      mesh=self._world()["mesh"])  # fmt: skip
        for key, (before, now) in config_changes(extra.get("config"), self._job.loaded.raw).items():
            _log.warning("resumed with a changed setting", key=key, checkpoint=before, now=now)
        return resumed

    def _explain_schedule(self, saved_config: Any, steps_done: int, before: float, now: float) -> None:
        """One line when the resumed learning rate leaves the checkpoint's course: the built-in
        schedule's own words for a changed total_steps (re-stretched, a wsd checkpoint past its decay,
        or wsd going on at the peak), else a warning when the learning rate changed (`before`: the
        one the checkpoint's schedule set for the next step, `now`: the schedule's as configured now)."""
        provider = self._job.lr_scheduler_provider
        total, saved_total = self._job.config.trainer.schedule.total_steps, _saved_total(saved_config)
        note = None
        if isinstance(provider, BuiltinLRSchedulerProvider) and saved_total is not None:
            note = provider.new_total_note(steps_done, saved_total, total)
        if note is not None:
            level, text = note
            log = _log.warning if level == "warning" else _log.info
            log(text, step=steps_done + 1, checkpoint_lr=before, lr=now)
        elif abs(before - now) > 1e-12 * max(abs(before), abs(now), 1e-30):
            _log.warning(
                "learning rate follows the schedule as configured now",
                step=steps_done + 1,
                checkpoint=before,
                now=now,
            )

    def _world(self) -> dict[str, Any]:
        """The processes and mesh this run trains on now (a checkpoint records them)."""
        mesh = self._job.config.mesh
        return {"size": mesh.world_size, "mesh": mesh.describe_degrees()}

    def save(self, step: int, callback_stop: CallbackStop | None = None) -> CheckpointInfo | None:
        """Save model, optimizer, data position, LR schedule, RNG and config as `save-<step>` (and
        `callback_stop`, when a callback ends the run at `step`); the committed checkpoint (None with
        async_save: the manager's `poll()`/`wait()` returns it)."""
        lora = self._job.config.peft.lora is not None
        extra = {
            "step": step,
            "data": self._data.state_dict(),
            "lr_scheduler": _plain(self._scheduler.state_dict()),
            "config": self._job.loaded.raw,
            "config_dir": str(self._job.loaded.base_dir.resolve()),
            "world": self._world(),
            **({"lora_base": self._starting.base_reference()} if lora else {}),
            **(
                {"early_stopping": self.early_stopping.state_dict()}
                if self.early_stopping is not None
                else {}
            ),
            **({"callback_stop": callback_stop.state()} if callback_stop is not None else {}),
            **({"task": self._task.state_dict()} if self._task is not None else {}),
        }
        if self._tokenizer is not None:  # the run directory keeps the tokenizer its weights train with
            self._tokenizer.record()
        # A LoRA run's checkpoint holds the adapters (and their optimizer state), not the frozen base.
        info = self.manager.save(
            step,
            self._model,
            self._optimizer,
            extra_state=extra,
            rank_state=capture_rng_state(),
            trainable_only=lora,
            metrics=self._eval_metrics,
            metrics_step=self._eval_step,
        )
        # d9d.ckpt logs "checkpoint committed" (rank 0, with its path) once the save is durable
        _log.debug("checkpoint saved", step=step, run_dir=str(self.manager.run_dir))
        return info


def _reapply_schedule(
    scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer
) -> tuple[int, float, float]:
    """Set the learning rate of the resumed step from the schedule as configured now; (steps done,
    the checkpoint's learning rate, the one set) of the first parameter group.

    The optimizer's checkpoint holds the learning rate the old schedule gave; with a changed
    total_steps (or schedule) the next step must use the new schedule's value, not the old one's
    (which was 0 at the end of a finished cosine run).
    """
    step = scheduler.last_epoch
    old = [group["lr"] for group in optimizer.param_groups]
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):  # its own state is all it has
        return step, old[0], old[0]
    new = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    for group, lr in zip(optimizer.param_groups, new, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(new)  # what get_last_lr() reports for this step
    return step, old[0], new[0]


def _saved_total(saved_config: Any) -> int | None:
    """`trainer.schedule.total_steps` of a checkpoint's config, None when it does not say."""
    if not isinstance(saved_config, dict):
        return None
    schedule = _get(saved_config, "trainer", "schedule", None)
    total = schedule.get("total_steps") if isinstance(schedule, dict) else None
    return total if isinstance(total, int) else None


#: Config sections whose change on resume is worth a line each (what the run now does differently).
_WATCHED = (
    "mesh",
    "data",
    "optimizer",
    "lr_scheduler",
    "trainer.schedule",
    "trainer.precision",
    "trainer.determinism",
    "model",
    "peft",
)


#: Keys a config may leave out, by watched section, with the value that then applies.
_DEFAULTS: dict[str, dict[str, Any]] = {"mesh": dict.fromkeys(DEGREE_KEYS, 1)}


def config_changes(saved: Any, current: Any) -> dict[str, tuple[Any, Any]]:
    """{key path: (value in the checkpoint's config, value now)} for the watched sections' leaves; a
    mesh degree left out of either config counts as its default, 1."""
    changes: dict[str, tuple[Any, Any]] = {}
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return changes

    def section(config: dict[str, Any], path: str) -> Any:
        node: Any = config
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return {**_DEFAULTS[path], **node} if path in _DEFAULTS and isinstance(node, dict) else node

    def walk(path: str, before: Any, now: Any) -> None:
        if isinstance(before, dict) and isinstance(now, dict):
            for key in sorted(set(before) | set(now)):
                walk(f"{path}.{key}", before.get(key), now.get(key))
        elif before != now:
            changes[path] = (before, now)

    for path in _WATCHED:
        walk(path, section(saved, path), section(current, path))
    return changes


def optimizer_change(saved: Any, current: Any) -> str | None:
    """ "optimizer.name adamw → sgd" when the checkpoint's config picked another optimizer; else None.

    The optimizer is picked by `providers.optimizer` and, for the built-in provider, `optimizer.name`
    (a key left out counts as its default); its hyperparameters (lr, betas, ...) keep the state valid.
    """
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return None
    builtin, default_name = ProvidersConfig(model="").optimizer, OptimizerConfig().name

    def picked(config: dict[str, Any]) -> tuple[Any, Any]:
        provider = _get(config, "providers", "optimizer", builtin)
        name = _get(config, "optimizer", "name", default_name) if provider == builtin else None
        return provider, name

    (provider_before, name_before), (provider_now, name_now) = picked(saved), picked(current)
    if provider_before != provider_now:
        return f"providers.optimizer {provider_before} → {provider_now}"
    if name_before != name_now:
        return f"optimizer.name {name_before} → {name_now}"
    return None


def _get(config: dict[str, Any], section: str, key: str, default: Any) -> Any:
    """`config[section][key]`, or `default` when either is missing."""
    node = config.get(section)
    return node.get(key, default) if isinstance(node, dict) else default


def _plain(state: Any) -> Any:
    """Round-trip through msgspec so only plain data (no tensors or callables) is checkpointed."""
    return msgspec.json.decode(msgspec.json.encode(state, enc_hook=lambda o: None))
