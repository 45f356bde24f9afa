"""Every directory a job writes, made absolute once: relative paths are taken from the config file's
directory, so the same config names the same run, logs and export wherever the job is started from.

`LoadedJob.paths` holds them; the settings check, the trainer, preflight, `finished_run` and the CLI
read them there instead of resolving the config's strings again.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from d9d.trainer.config.job import JobConfig

__all__ = ["JobPaths", "resolve_path"]


def resolve_path(base_dir: Path, value: str | os.PathLike[str]) -> Path:
    """`value` as an absolute path (`~` expanded); a relative one is taken from `base_dir`."""
    path = Path(value).expanduser()
    return Path(os.path.abspath(path if path.is_absolute() else base_dir / path))


@dataclass(frozen=True)
class JobPaths:
    """The job's directories, absolute.

    Attributes:
        base_dir: the config file's directory (the working directory for a config given as a dict).
        run_dir: `trainer.checkpointing.save_dir/trainer.run.name`: checkpoints, metrics, the lock.
        log_dir: `trainer.logging.log_dir`, None when not set.
        export_dir: `export.dir`, None when not set.
        profile_dir: `trainer.profiling.dir`, else `run_dir/profile`.
        tensorboard_dir: `trainer.tracking.tensorboard_dir`, else `run_dir/tensorboard`.
        wandb_dir: `trainer.tracking.wandb_dir`, else `run_dir`.
        written: config key -> directory, for each directory the config names and the job writes
            (a file in its way is refused before anything starts).
    """

    base_dir: Path
    run_dir: Path
    log_dir: Path | None
    export_dir: Path | None
    profile_dir: Path
    tensorboard_dir: Path
    wandb_dir: Path
    written: Mapping[str, Path]

    @classmethod
    def of(cls, config: JobConfig, base_dir: Path) -> "JobPaths":
        """The directories `config` names, taken from `base_dir`."""
        trainer = config.trainer
        tracking, profiling = trainer.tracking, trainer.profiling
        run_dir = resolve_path(base_dir, trainer.checkpointing.save_dir) / trainer.run.name
        written = {"trainer.checkpointing.save_dir": run_dir}

        def named(key: str, value: str | None, used: bool = True) -> Path | None:
            if value is None or not used:
                return None
            written[key] = path = resolve_path(base_dir, value)
            return path

        log_dir = named("trainer.logging.log_dir", trainer.logging.log_dir)
        export_dir = named("export.dir", config.export.dir)
        profile_dir = named("trainer.profiling.dir", profiling.dir, bool(profiling.active_steps))
        tensorboard = named("trainer.tracking.tensorboard_dir", tracking.tensorboard_dir,
                            "tensorboard" in tracking.backends)  # fmt: skip
        wandb = named("trainer.tracking.wandb_dir", tracking.wandb_dir, "wandb" in tracking.backends)
        return cls(
            base_dir=base_dir,
            run_dir=run_dir,
            log_dir=log_dir,
            export_dir=export_dir,
            profile_dir=profile_dir or run_dir / "profile",
            tensorboard_dir=tensorboard or run_dir / "tensorboard",
            wandb_dir=wandb or run_dir,
            written=written,
        )
