"""Experiment trackers: TensorBoard, Weights & Biases and MLflow receive the records of metrics.jsonl.

`trainer.tracking.backends` picks them (`jsonl`, the metrics file, is always written). Each record's
numeric fields go to every tracker as one series per field, against the record's step: whatever
`d9d.trainer.observe.records` puts on a record (loss, grad_norm, lr, tokens, step_time_s, eval_loss, the
step-time breakdown...) needs no change here; booleans (`skipped`) and text (`launch`) stay in the
file only. Rank 0 writes; the other ranks create nothing. A tracker gets the records when the metrics
file does (at logging steps, before a checkpoint, at the end), so it costs nothing on other steps.

A resumed run continues the same tracker run, each step once and in order. The metrics file drops
the records after the resumed checkpoint (`truncate_metrics`) and the run redoes those steps (bit
for bit), so:

- TensorBoard writes to the same directory with `purge_step` = the first redone step: TensorBoard
  drops the older events of that step and later ones when it reads the directory.
- W&B and MLflow keep their run id in `<run_dir>/tracking.json`, resume that run, and skip the steps
  the run already has (the redone steps equal them). W&B's last step is the one kept in that file
  (offline runs keep none on a server) or the server's, whichever is later; MLflow's is read from
  the run's metric history.

A tracker that fails while the run trains (a full disk, a lost connection) is reported once and left
out for the rest of the launch: the training and metrics.jsonl go on.
"""

import contextlib
import importlib.util
import json
import os
import secrets
import string
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from d9d.mesh import get_logger, one_line
from d9d.trainer.config.trainer import TrackingConfig
from d9d.trainer.errors import ConfigError, TrainingError
from d9d.trainer.job.load import LoadedJob

__all__ = [
    "STATE_FILE",
    "Tracker",
    "Trackers",
    "check_trackers",
    "install_hint",
    "numeric_fields",
    "open_trackers",
]

#: The tracker run ids of a run (W&B, MLflow), in `save_dir/run.name/`, so a resume continues them.
STATE_FILE = "tracking.json"

#: backend → (the module it imports, the distribution that has it); its extra has the backend's name.
_LIBRARIES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}

#: An MLflow param value longer than this is cut (the store's limit is 6000 characters).
_PARAM_CHARS = 6000

_log = get_logger("d9d.trainer")

Rows = Sequence[tuple[int, dict[str, float]]]


def install_hint(backend: str) -> str:
    """How to install a backend's extra (in the workspace it is d9d-trainer's, hence `--all-packages`)."""
    return (
        f"install it with `uv sync --all-packages --extra {backend}` in the d9d workspace "
        f"or `pip install 'd9d-trainer[{backend}]'`"
    )


def check_trackers(config: TrackingConfig) -> None:
    """Refuse, before anything is written, a backend whose library is not installed.

    Raises:
        ConfigError: one line naming the backend, its extra and the install command.
    """
    for backend in config.backends:
        if backend not in _LIBRARIES:
            continue
        module, distribution = _LIBRARIES[backend]
        if not _importable(module):
            raise ConfigError(
                f"trainer.tracking.backends: {backend} needs {distribution} (the `{module}` module), which "
                f"is not installed; {install_hint(backend)}, or remove {backend} from trainer.tracking.backends"
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def numeric_fields(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a record (not `step`, not booleans); a nested mapping's as `outer/inner`."""
    values: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or (not prefix and key == "step"):
            continue
        if isinstance(value, int | float):
            values[name] = float(value)
        elif isinstance(value, Mapping):
            values.update(numeric_fields(value, f"{name}/"))
    return values


class Tracker(Protocol):
    """One backend: takes (step, numeric fields) rows in step order, and is closed once.

    `last_step` is the last step its run already holds from earlier launches (0 when it keeps none,
    or when a resumed launch replaces the steps it redoes, as TensorBoard's `purge_step` does).
    """

    name: str

    @property
    def last_step(self) -> int:
        """The last step the tracker's run kept from earlier launches."""
        ...

    def log(self, rows: Rows) -> None:
        """Record these steps' values."""
        ...

    def close(self, *, failed: bool) -> None:
        """End this launch's part of the tracker run (`failed`: the launch ended with an error)."""
        ...


class Trackers:
    """The trackers of rank 0 (none on the other ranks, and with only `jsonl`)."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self._trackers = list(trackers)

    @property
    def names(self) -> list[str]:
        """The backends that still receive records."""
        return [t.name for t in self._trackers]

    def take(self, other: "Trackers") -> None:
        """Move `other`'s trackers into this set (e.g. into the one a `StepRecords` already holds)."""
        self._trackers += other._trackers
        other._trackers = []

    def log(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Send the records' numeric fields to every tracker; one that fails is reported and left out."""
        if not self._trackers:
            return
        rows = [(int(r["step"]), numeric_fields(r)) for r in records]
        for tracker in list(self._trackers):
            try:
                tracker.log(rows)
            except Exception as exc:
                self._trackers.remove(tracker)
                _log.warning(
                    f"the {tracker.name} tracker failed and gets no more records in this launch "
                    f"(metrics.jsonl still has them): {type(exc).__name__}: {one_line(exc)}",
                    step=rows[-1][0] if rows else None,
                )
                with contextlib.suppress(Exception):
                    tracker.close(failed=True)

    def close(self, *, failed: bool = False) -> None:
        """Close every tracker (each once; one that fails to close does not keep the others open)."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                tracker.close(failed=failed)
            except Exception as exc:
                _log.warning(
                    f"closing the {tracker.name} tracker failed: {type(exc).__name__}: {one_line(exc)}"
                )


def open_trackers(loaded: LoadedJob, run_dir: Path, *, start_step: int, writer: bool) -> Trackers:
    """Start (or resume) the configured trackers for a launch that begins after step `start_step`.

    Args:
        loaded: the job config (its `trainer.tracking` section, the run name, the config recorded).
        run_dir: `save_dir/run.name`, where the trackers' files go by default.
        start_step: the step resumed from (0 for a new run).
        writer: this rank writes (rank 0); the others get no trackers.

    Raises:
        TrainingError: a tracker could not be started (e.g. W&B online without a login).
    """
    config = loaded.config.trainer.tracking
    backends = [b for b in config.backends if b != "jsonl"]
    if not writer or not backends:
        return Trackers()
    check_trackers(config)
    run_name = loaded.config.trainer.run.name
    job_config = msgspec.to_builtins(loaded.config)
    state = _RunState(run_dir / STATE_FILE)

    opened: list[Tracker] = []
    try:
        for backend in backends:
            try:
                if backend == "tensorboard":
                    opened.append(
                        _TensorBoardTracker(loaded.paths.tensorboard_dir, run_name, job_config, start_step)
                    )
                elif backend == "wandb":
                    opened.append(_WandbTracker(config, loaded.paths.wandb_dir, run_name, job_config, state))
                elif backend == "mlflow":
                    default_uri = (run_dir / "mlruns").resolve().as_uri()
                    opened.append(_MlflowTracker(config, default_uri, run_name, job_config, state))
            except Exception as exc:
                raise TrainingError(
                    f"trainer.tracking: the {backend} tracker could not start: {type(exc).__name__}: "
                    f"{one_line(exc)}; fix its settings in trainer.tracking or remove {backend} "
                    "from trainer.tracking.backends"
                ) from exc
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    _log.info("trackers", backends=[t.name for t in opened], resumed_after=start_step or None)
    for tracker in opened:
        kept = tracker.last_step
        if kept > start_step:  # the run logged steps that this launch redoes
            _log.warning(
                f"the {tracker.name} run already has steps {start_step + 1}..{kept}, which this launch redoes: "
                "they keep the first launch's values there (metrics.jsonl and TensorBoard get the new ones); "
                "equal unless the resume changed a setting",
                steps_kept=kept - start_step,
            )
    return Trackers(opened)


class _RunState:
    """`tracking.json`: {backend: {...}}, rewritten whole (temp file + rename) on every change."""

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            loaded = {}
        self._state: dict[str, dict[str, Any]] = loaded if isinstance(loaded, dict) else {}

    def get(self, backend: str) -> dict[str, Any]:
        """This backend's entry (empty for a new run)."""
        entry = self._state.get(backend)
        return dict(entry) if isinstance(entry, dict) else {}

    def set(self, backend: str, **entry: Any) -> None:
        """Replace this backend's entry, on disk at once."""
        self._state[backend] = entry
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(self._path.name + ".tmp")
        tmp.write_text(json.dumps(self._state, indent=1) + "\n", encoding="utf-8")
        tmp.replace(self._path)


class _TensorBoardTracker:
    """Scalars per field in `directory`; a resumed launch purges the steps it redoes (`purge_step`)."""

    name = "tensorboard"
    last_step = 0  # a resumed launch purges the steps it redoes

    def __init__(self, directory: Path, run_name: str, job_config: dict[str, Any], start_step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=start_step + 1)
        self._writer.add_text("run", run_name, global_step=start_step)
        text = json.dumps(job_config, indent=2, default=str)
        self._writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), start_step)
        self._writer.flush()

    def log(self, rows: Rows) -> None:
        """One event per step with a scalar per field, flushed at once (a crash loses only redone steps).

        What `add_scalar` writes, a field at a time; one event per step is ~10x cheaper.
        """
        events = self._writer._get_file_writer()
        for step, values in rows:
            summary = self._summary(
                value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
            )
            events.add_summary(summary, step)
        self._writer.flush()

    def close(self, *, failed: bool) -> None:
        """Flush and close the event file."""
        self._writer.close()


class _WandbTracker:
    """A W&B run with the run's id (kept in tracking.json), resumed by later launches."""

    name = "wandb"

    def __init__(
        self,
        config: TrackingConfig,
        directory: Path,
        run_name: str,
        job_config: dict[str, Any],
        state: _RunState,
    ) -> None:
        import wandb

        self._wandb = wandb
        self._state = state
        entry = state.get("wandb")
        run_id = str(entry.get("id") or _new_wandb_id())
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.project,
            entity=config.wandb_entity,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(directory),
            mode=config.wandb_mode,
            config=job_config,
            settings=wandb.Settings(console="off"),  # the trainer's output stays its own
        )
        # Offline, W&B has no history to resume from: the last step this file saw logged is it.
        self._last = max(int(entry.get("last_step", 0)), int(self._run.starting_step) - 1)
        self._id = run_id
        state.set("wandb", id=run_id, last_step=self._last)

    @property
    def last_step(self) -> int:
        """The last step the W&B run has."""
        return self._last

    def log(self, rows: Rows) -> None:
        """The steps after the run's last one, each with its step number."""
        logged = False
        for step, values in rows:
            if step <= self._last:
                continue  # redone after a resume: the run has it already (equal, the resume is exact)
            self._run.log(values, step=step)
            self._last = step
            logged = True
        if logged:
            self._state.set("wandb", id=self._id, last_step=self._last)

    def close(self, *, failed: bool) -> None:
        """Finish the run and stop W&B's service process (no process is left behind)."""
        try:
            self._run.finish(exit_code=1 if failed else 0)
        finally:
            self._wandb.teardown()


def _new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class _MlflowTracker:
    """An MLflow run (its id kept in tracking.json), resumed by later launches; params, config artifact."""

    name = "mlflow"

    def __init__(
        self,
        config: TrackingConfig,
        default_uri: str,
        run_name: str,
        job_config: dict[str, Any],
        state: _RunState,
    ) -> None:
        uri = config.mlflow_tracking_uri or default_uri
        if uri.startswith("file:"):  # MLflow 3 asks for this opt-in to its (maintained) file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._client = MlflowClient(tracking_uri=uri)
        entry = state.get("mlflow")
        run = None
        # The id is kept with the configured URI (None: the default store, wherever the run dir is).
        if entry.get("run_id") and entry.get("tracking_uri") == config.mlflow_tracking_uri:
            try:
                run = self._client.get_run(entry["run_id"])
            except Exception as exc:
                _log.warning(f"MLflow run {entry['run_id']} not found ({one_line(exc)}); starting a new one")
        if run is None:
            experiment = self._client.get_experiment_by_name(config.project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(config.project)
            )
            run = self._client.create_run(experiment_id, run_name=run_name)
        else:
            self._client.update_run(run.info.run_id, status="RUNNING")
        self._run_id = run.info.run_id
        self._last = max(
            (m.step for key in run.data.metrics for m in self._client.get_metric_history(self._run_id, key)),
            default=0,
        )
        # Params cannot change once logged: new keys only; the config of every launch is the artifact.
        params = {k: v for k, v in _flatten(job_config).items() if k not in run.data.params}
        self._client.log_batch(self._run_id, params=[Param(k, v[:_PARAM_CHARS]) for k, v in params.items()])
        self._client.log_dict(self._run_id, job_config, "d9d/config.json")
        state.set("mlflow", tracking_uri=config.mlflow_tracking_uri, run_id=self._run_id)

    @property
    def last_step(self) -> int:
        """The last step the MLflow run has."""
        return self._last

    def log(self, rows: Rows) -> None:
        """The steps after the run's last one, in one batch."""
        now = int(time.time() * 1000)
        metrics = [
            self._metric(key, value, now, step)
            for step, values in rows
            if step > self._last  # redone after a resume: the run has it already
            for key, value in values.items()
        ]
        if metrics:
            self._client.log_batch(self._run_id, metrics=metrics)
            self._last = max(step for step, _ in rows)

    def close(self, *, failed: bool) -> None:
        """Mark the run FINISHED (or FAILED)."""
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"a": {"b": 1}}` → `{"a.b": "1"}`; lists as JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat
