"""`run_job`, `run_command` and `main`: the one code path behind `python train.py config.yaml` and
`d9d train`.

The config is loaded and checked, and a finished run recognized, before torch or the trainer is
imported: a bad config or a launch that does not fit the mesh fails at once, and a run whose latest
checkpoint reached `total_steps` says so from that checkpoint's commit record (`finished_run`),
without building the model or loading the checkpoint. Its providers are still imported and
constructed from their sections first (which imports torch), so a wrong key in a provider's section
fails a finished run as it fails any other.
"""

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from d9d.ckpt import list_checkpoints, uncommitted_step_dirs
from d9d.mesh import RendezvousError, check_launch
from d9d.trainer.errors import verdict_of
from d9d.trainer.faults.reporting import report_job_error
from d9d.trainer.job.load import LoadedJob, load_job_config
from d9d.trainer.results import TrainResult

__all__ = ["finished_run", "main", "run_command", "run_job"]


def run_job(config_path: str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """Load the config, build the job, train (resuming if the run has checkpoints), export if set.

    A run that is already complete (`finished_run`) returns before anything is built.
    On a failure under a multi-process launch, the ranks first agree on who reports it (see
    `d9d.trainer.faults.reporting`); the exception carries the verdict.
    """
    try:
        # A bad config, or a launch that does not fit the mesh, fails here, before torch is imported
        # (in the order the build would find them: the settings first, then the launch).
        loaded = load_job_config(config_path, overrides)
        check_launch(loaded.config.mesh, os.environ)
        finished = finished_run(loaded)
        if finished is not None:
            return finished
        from d9d.trainer.trainer import Trainer  # torch, the providers and the whole training stack

        trainer = Trainer.from_config(loaded)
        with trainer:
            result = trainer.train()
            if not result.preempted and loaded.config.export.dir is not None:
                out = trainer.export()  # a run stopped by a signal is unfinished: no export
                if trainer.context.is_main_process:
                    _record_export(trainer.run_dir, trainer.step, out)
        return result
    except Exception as exc:
        _agree(exc)
        raise


def finished_run(loaded: LoadedJob) -> TrainResult | None:
    """The result of a run that is already complete, decided from its checkpoints' commit records alone.

    A run is complete when its latest committed checkpoint reached `trainer.schedule.total_steps`.
    Then this checks the whole config as a build would (`resolve_job`: every provider imported and
    constructed from its section; nothing built, loaded or written), logs "run is already complete"
    (as `Trainer.train()` does after a resume) and returns a result with no steps. None when the run
    must be built: it is not complete, its directory holds a `save-<step>` that is not committed (the
    resume reports it), or `export.dir` is set and does not hold that checkpoint's export yet
    (`run_job` records each export it writes in the run's `exported.json`: the step and the folder).

    Every rank reads the same (shared) run directory, as a resume does, so all ranks decide alike.

    Raises:
        ConfigError: a provider's (or a callback's) section does not fit it, as `resolve_job` says.
    """
    tcfg, paths = loaded.config.trainer, loaded.paths
    run_dir, export_dir = paths.run_dir, paths.export_dir
    found = list_checkpoints(run_dir)
    total = tcfg.schedule.total_steps
    if not found or found[-1].step < total or uncommitted_step_dirs(run_dir):
        return None
    if export_dir is not None and not _exported(run_dir, found[-1].step, export_dir):
        return None
    from d9d.mesh import configure_logging, get_logger  # structlog: only to say it
    from d9d.trainer.job.resolve import resolve_job  # the providers' own modules (and torch)

    resolve_job(loaded)  # the providers' sections are checked when they are constructed
    latest = found[-1]
    configure_logging(format=tcfg.logging.format, level=tcfg.logging.level, log_dir=paths.log_dir)
    exported = {"export": str(export_dir)} if export_dir is not None else {}
    get_logger("d9d.trainer").info(
        "run is already complete",
        step=latest.step,
        total_steps=total,
        checkpoint=str(latest.path),
        **exported,
    )
    return TrainResult(start_step=latest.step, final_step=latest.step, losses=[])


#: In a run directory: what the last finished launch exported (step, folder), so a restart of the
#: finished run knows its export is there.
EXPORT_RECORD = "exported.json"


def _record_export(run_dir: Path, step: int, out: Path) -> None:
    record = run_dir / EXPORT_RECORD
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "dir": str(Path(out).resolve())}) + "\n", encoding="utf-8")
    tmp.replace(record)


def _exported(run_dir: Path, step: int, export_dir: Path) -> bool:
    """Whether the run's export record says `export_dir` holds the export of checkpoint `step`."""
    try:
        record = json.loads((run_dir / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("step") != step:
        return False
    return (
        record.get("dir") == str(export_dir.resolve()) and export_dir.is_dir() and any(export_dir.iterdir())
    )


def run_command(config_path: str | Path, overrides: Sequence[str] = ()) -> None:
    """`run_job` with a command's exit: Ctrl-C prints how to resume and exits `EXIT_INTERRUPTED`
    (130); a run stopped and saved by SIGTERM exits `EXIT_PREEMPTED`; a finished run returns (one a
    callback stopped included: it is finished, and a requeue on a non-zero status would loop).

    Errors propagate, for the caller to report (`report_job_error`).
    """
    try:
        result = run_job(config_path, overrides)
    except KeyboardInterrupt:
        from d9d.trainer.run.signals import EXIT_INTERRUPTED, INTERRUPTED_MESSAGE

        print(INTERRUPTED_MESSAGE, file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    if result.preempted:  # saved after SIGTERM / Ctrl-C: run the same command to resume
        from d9d.trainer.run.signals import EXIT_PREEMPTED

        sys.exit(EXIT_PREEMPTED)


def _agree(exc: Exception) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size <= 1 or "RANK" not in os.environ or verdict_of(exc) is not None:
        return  # one process, or the ranks agreed already (a failed step: see FailureBoard)
    from d9d.trainer.faults.failures import agree_on_error, error_store, mark_own_error  # torch.distributed

    store = error_store()
    if store is not None:
        agree_on_error(exc, store, int(os.environ["RANK"]), world_size)
    elif isinstance(exc, RendezvousError):  # no store to agree through: this rank must say it itself
        mark_own_error(exc, int(os.environ["RANK"]))


def _overrides(args: Sequence[str]) -> list[str]:
    """`key=val`, `--set key=val` and `--set=key=val`, in order; a `--set` with no value after it exits 2."""
    overrides = []
    rest = iter(args)
    for arg in rest:
        if arg == "--set":
            arg = next(rest, None)
            if arg is None or arg.startswith("-"):
                print("error: --set needs an override after it: key.path=value", file=sys.stderr)
                sys.exit(2)
        overrides.append(arg.removeprefix("--set="))
    return overrides


def main(argv: Sequence[str] | None = None) -> None:
    """`python train.py CONFIG [key.path=value ...]`: run the job; errors are one line and exit 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python train.py CONFIG.yaml [key.path=value ...]", file=sys.stderr)
        sys.exit(0 if args else 2)
    overrides = _overrides(args[1:])
    try:
        run_command(args[0], overrides)
    except Exception as exc:
        if not report_job_error(exc):
            raise  # a bug, not a user's mistake: its traceback
        sys.exit(2)
