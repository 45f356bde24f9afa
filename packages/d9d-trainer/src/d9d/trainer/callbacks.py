"""Callbacks: the user's own code at the points of a run, without subclassing or copying the trainer.

A callback subclasses `Callback` and overrides the events it wants (each a no-op by default):

- `on_job_built(run)`: `train()` starts, the job is built (and resumed); `run.plan` says what was built.
- `on_step(run, record)`: a step's record, as written to metrics.jsonl. Records are read from the
  device when they are written (every `trainer.logging.period_steps` steps, on an eval step and on
  the last step), so the records of the steps since come then, in order; no extra host sync.
- `on_eval(run, result)`: an eval finished (`EvalResult`, the same numbers on every rank).
- `on_checkpoint(run, step, path)`: a checkpoint is committed (with `async_save`, at the end of the
  first step after the commit, or when the run ends).
- `on_train_end(run, result)`: `train()` returns (`TrainResult`).
- `on_failure(run, error)`: the run stops on an error that reached this rank's loop (a callback
  failing here is logged, not raised); a rank that another rank's failure stops may exit first.

`main_process_only = True` (the default) runs a callback on rank 0 only, e.g. for logging or
notifications; set it False to run it on every rank, e.g. to look at each rank's model shard.

A callback steers the run through `run` (a `RunControl`): `run.request_stop(reason)` ends the run
and `run.request_save()` saves a checkpoint, both at the end of the next step to start: the request
rides on that step's one existing sync (the finiteness check's read, agreed over every rank), so a
request made on rank 0 alone stops or saves every rank at the same step, and costs nothing. A run a
callback stopped is finished, as one early stopping ended: that step is saved, the checkpoint
records which callback stopped it (`d9d.trainer.run.callback_stop`), the command exits 0, and
starting it again says the run already stopped while that callback is still among the run's (a
signal's stop, by contrast, is resumed: exit 75).

A callback that raises stops the job with its error on every rank, like any other failure.

Callbacks come from the config, `trainer.callbacks: [file.py:MyCallback, {target: pkg.mod:Other,
config: {...}}]` (resolved like providers: a class constructed with its `config` section, converted
into its `config_type` when it declares one), and from Python: `Trainer(job, callbacks=[...])`. They
run in that order: the config's first.
"""

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from d9d.mesh import get_logger

if TYPE_CHECKING:
    import torch

    from d9d.trainer.planning.plan import JobPlan
    from d9d.trainer.results import EvalResult, TrainResult

__all__ = ["Callback", "RunControl"]

_log = get_logger("d9d.trainer")


class RunControl:
    """What a callback sees of the run, and how it asks the loop to stop or save.

    Attributes:
        run_dir: `save_dir/run.name`.
        rank: this process's global rank.
        is_main_process: rank 0.
        plan: what the job built (`d9d.trainer.planning.plan_job`'s `JobPlan`).
        model: this rank's (parallelized) model.
    """

    def __init__(self, *, run_dir: Path, rank: int, is_main_process: bool, plan: "JobPlan",
                 model: "torch.nn.Module") -> None:  # fmt: skip
        self.run_dir = run_dir
        self.rank = rank
        self.is_main_process = is_main_process
        self.plan = plan
        self.model = model
        self.step = 0
        self._stop_reason: str | None = None
        self._stop_callback: str | None = None
        self._calling: str | None = None  # the callback whose event runs now (`Callbacks` sets it)
        self._save = False

    def request_stop(self, reason: str) -> None:
        """End the run, finished, at the end of the next step to start (which is saved); `reason` is
        logged and becomes `TrainResult.stopped_by`. The first request counts."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_callback = self._calling

    def request_save(self) -> None:
        """Save a checkpoint at the end of the next step (one, however often it is asked)."""
        self._save = True

    @property
    def stop_requested(self) -> bool:
        """A stop was requested on this rank."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The reason given to `request_stop` on this rank, None without one."""
        return self._stop_reason

    @property
    def stop_callback(self) -> str | None:
        """The class name of the callback that called `request_stop` on this rank from one of its
        events (None: no request, or one made outside an event)."""
        return self._stop_callback

    def take_save_request(self) -> bool:
        """Whether a save was requested on this rank since the last call (the loop reads it once a step)."""
        requested, self._save = self._save, False
        return requested


class Callback:
    """Base class of a callback: override the events you need (see `d9d.trainer.callbacks`).

    Constructed with its config section (`self.config`; `{}` when the config names no `config:`,
    None when constructed in Python without one).
    """

    #: Run on rank 0 only (True) or on every rank (False).
    main_process_only: ClassVar[bool] = True

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def on_job_built(self, run: RunControl) -> None:
        """`train()` starts on the built (and resumed) job."""

    def on_step(self, run: RunControl, record: Mapping[str, Any]) -> None:
        """A step's metrics.jsonl record (loss, grad_norm, lr, tokens_per_s, eval_loss on an eval step, ...)."""

    def on_eval(self, run: RunControl, result: "EvalResult") -> None:
        """An eval finished."""

    def on_checkpoint(self, run: RunControl, step: int, path: Path) -> None:
        """The checkpoint of `step` is committed at `path`."""

    def on_train_end(self, run: RunControl, result: "TrainResult") -> None:
        """`train()` returns."""

    def on_failure(self, run: RunControl, error: BaseException) -> None:
        """The run stops on `error` (raising here is logged and ignored: the error stays the job's)."""


class Callbacks:
    """The job's callbacks on this rank, in order, and the control they share."""

    def __init__(self, callbacks: Sequence[Callback], *, is_main_process: bool) -> None:
        self._callbacks = [c for c in callbacks if is_main_process or not c.main_process_only]
        #: The class names of the job's callbacks, those of every rank (the same on each).
        self.names = frozenset(type(c).__name__ for c in callbacks)
        self.control: RunControl | None = None

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def start(self, control: RunControl) -> None:
        self.control = control
        for callback in self._callbacks:
            with self._calling(callback):
                callback.on_job_built(control)

    def steps(self, records: Sequence[Mapping[str, Any]]) -> None:
        control = self._control()
        for record in records:
            control.step = int(record["step"])
            for callback in self._callbacks:
                with self._calling(callback):
                    callback.on_step(control, record)

    def evaluated(self, result: "EvalResult") -> None:
        control = self._control()
        for callback in self._callbacks:
            with self._calling(callback):
                callback.on_eval(control, result)

    def committed(self, step: int, path: Path) -> None:
        control = self._control()
        for callback in self._callbacks:
            with self._calling(callback):
                callback.on_checkpoint(control, step, path)

    def ended(self, result: "TrainResult") -> None:
        control = self._control()
        for callback in self._callbacks:
            callback.on_train_end(control, result)

    def failed(self, error: BaseException) -> None:
        if self.control is None:
            return
        for callback in self._callbacks:
            try:
                callback.on_failure(self.control, error)
            except Exception as exc:  # the job's error stays the one reported
                with contextlib.suppress(Exception):
                    _log.warning(
                        f"callback {type(callback).__name__}.on_failure raised {type(exc).__name__}: {exc}"
                    )

    def stop_requested(self) -> bool:
        """A callback of this rank asked the run to stop (read once a step, agreed in its sync)."""
        return self.control is not None and self.control.stop_requested

    def take_save_request(self) -> bool:
        """A callback of this rank asked for a checkpoint since the last step (read once a step)."""
        return self.control is not None and self.control.take_save_request()

    def _control(self) -> RunControl:
        assert self.control is not None, "callbacks before start()"
        return self.control

    @contextlib.contextmanager
    def _calling(self, callback: Callback) -> Iterator[None]:
        """While one callback's event runs: a stop it requests is known as its (`stop_callback`)."""
        control = self._control()
        control._calling = type(callback).__name__
        try:
            yield
        finally:
            control._calling = None
