"""`d9d export`: write a checkpoint's model as safetensors through the model provider's export mapper.

From a run directory, the job is rebuilt from the config stored in the checkpoint. That config names
`file.py:Name` providers (and data files) relative to the directory of the original config file,
which the checkpoint records (`config_dir`) but which may have moved since, or which older
checkpoints lack; `find_config_dir` looks for it where it usually is.

Everything the command prints is a log line of the trainer's format (the trainer configures the
logging; the command's own last line is `d9d.cli: export finished`); errors are one `error:` line.
"""

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from d9d.cli.commands._options import overrides_option
from d9d.cli.commands._runs import best_policy, check_run_dir, scan_run_dir
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # the trainer imports torch: only inside the command at run time
    from d9d.ckpt import CheckpointInfo
    from d9d.trainer import LoadedJob

__all__ = [
    "committed_checkpoint",
    "export",
    "find_config_dir",
    "loaded_from_run",
    "relative_provider_files",
    "single_process_mesh",
    "with_values",
]


def relative_provider_files(raw: dict[str, Any]) -> list[str]:
    """The relative `file.py` parts of the `providers:` import paths of a raw config."""
    providers = raw.get("providers") or {}
    files = []
    for spec in providers.values() if isinstance(providers, dict) else ():
        target = str(spec).rpartition(":")[0]
        if target.endswith(".py") and not Path(target).is_absolute():
            files.append(target)
    return files


def find_config_dir(
    raw: dict[str, Any], run_dir: Path, cwd: Path, stored: str | None = None
) -> tuple[Path | None, list[Path]]:
    """The directory a stored config's relative provider files resolve in, and the places tried.

    Tried in order: `stored` (a config directory the trainer kept with the config), the directory
    a relative `trainer.checkpointing.save_dir` was taken from (the run directory minus save_dir),
    the current directory and the run directory's parents; then the subdirectories of those, where
    exactly one must hold the files (or one whose YAML file names the same providers). None when
    the config has no relative file or no unambiguous place holds them all.
    """
    files = relative_provider_files(raw)
    candidates: list[Path] = []
    if stored:
        candidates.append(Path(stored))
    save_dir = ((raw.get("trainer") or {}).get("checkpointing") or {}).get("save_dir", "runs")
    if isinstance(save_dir, str) and not Path(save_dir).is_absolute():
        started_in = run_dir.resolve().parent
        for _ in Path(save_dir).parts:
            started_in = started_in.parent
        candidates.append(started_in)
    candidates += [cwd, run_dir.resolve().parent, run_dir.resolve().parent.parent]
    tried = [c for c in dict.fromkeys(c.resolve() for c in candidates) if c.is_dir()]
    if not files:
        return None, tried

    def holds_all(directory: Path) -> bool:
        return all((directory / f).is_file() for f in files)

    for directory in tried:
        if holds_all(directory):
            return directory, tried
    children = [
        c for parent in tried for c in sorted(parent.iterdir()) if c.is_dir() and not c.name.startswith(".")
    ]
    found = list(dict.fromkeys(c for c in children if holds_all(c)))
    if len(found) > 1:
        found = [c for c in found if _names_providers(c, raw.get("providers"))]
    return (found[0] if len(found) == 1 else None), tried


def _names_providers(directory: Path, providers: Any) -> bool:
    """True when a YAML file in `directory` has exactly this `providers:` section."""
    import yaml

    for path in [*directory.glob("*.yaml"), *directory.glob("*.yml")]:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and data.get("providers") == providers:
            return True
    return False


def single_process_mesh(loaded: "LoadedJob") -> "LoadedJob":
    """Outside torchrun, export in this one process (checkpoints reshard to any mesh).

    Only the degrees that are not 1 already are set, so that the trainer's "resumed with a changed
    setting" warnings name what export really changed.
    """
    if "WORLD_SIZE" in os.environ:
        return loaded
    from d9d.mesh import DEGREE_KEYS  # imports torch: only when the command runs

    mesh = loaded.config.mesh
    changes = {f"mesh.{key}": 1 for key in DEGREE_KEYS if getattr(mesh, key) != 1}
    return with_values(loaded, changes) if changes else loaded


def with_values(loaded: "LoadedJob", values: dict[str, Any]) -> "LoadedJob":
    """`loaded` with some `a.b.c` keys set (in the raw dict: no YAML typing of the values), path kept."""
    from d9d.trainer import load_job_config

    raw = copy.deepcopy(loaded.raw)
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            child = node.get(part)
            node[part] = child = child if isinstance(child, dict) else {}
            node = child
        node[leaf] = value
    return load_job_config(raw, config_path=loaded.path)


@click.command(short_help="Export a checkpoint as safetensors.")
@click.argument("source", metavar="CONFIG_OR_RUN_DIR", type=click.Path())
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(),
    help="Directory to write (created if needed; an earlier export in it is replaced).",
)
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step to export (default: the latest).")
@click.option(
    "--best",
    is_flag=True,
    help="Export the best checkpoint by its recorded eval metric (see `d9d checkpoints`).",
)
@overrides_option
@reports_errors
def export(source: str, out_dir: str, step: int | None, best: bool, overrides: Sequence[str]) -> None:
    """Export a checkpoint's model as safetensors files (sharded, with an index).

    The tensor names and any config.json are the model provider's mapper's: the model d9d ships
    (d9d.trainer.models: the quickstart, the `d9d init` templates, d9d.trainer:HFModelProvider) and
    the Hugging Face backend write a folder transformers loads.

    CONFIG_OR_RUN_DIR is either the job's config file (its run directory is save_dir/run.name) or a
    run directory, whose checkpoint holds the config the job ran with. The model goes through the
    model provider's prepare_export_model_stage() mapper. Run as one process, the mesh is set to
    1 process (any checkpoint reshards); under torchrun the config's mesh is kept. --out is treated
    as the config's export.dir is at the end of training: an earlier export's safetensors files in
    it are replaced, anything else in it is kept.

    \b
    Examples:
      d9d export runs/quickstart --out exported/
      d9d export runs/quickstart --out exported-50/ --step 50
      d9d export runs/quickstart --out best/ --best
      d9d export config.yaml --out exported/ --set trainer.run.name=try2
    """
    if best and step is not None:
        raise CliError("--best and --step both pick the checkpoint to export; pass one of them")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; pass a directory to write the safetensors files into")
    src = Path(source)
    if not src.exists():
        raise CliError(
            f"{src}: no such config file or run directory; pass the job's config file or its run "
            "directory (save_dir/run.name, e.g. runs/quickstart)"
        )

    from d9d.trainer import load_job_config

    if src.is_dir():
        run_dir = check_run_dir(src)
        info = committed_checkpoint(run_dir, step, best=best)
        loaded = loaded_from_run(run_dir, info, list(overrides))
    else:
        loaded = load_job_config(src, list(overrides))
        run_dir = loaded.paths.run_dir
        info = committed_checkpoint(run_dir, step, best=best)
    loaded = single_process_mesh(loaded)

    from d9d.mesh import get_logger
    from d9d.trainer import Trainer

    # Read-only: no run lock (a job may be training this run) and nothing written into the run. The
    # step is pinned: a checkpoint that such a job commits meanwhile is not the one chosen here.
    with Trainer.from_config(loaded, read_only=True) as trainer:
        trainer.resume(info.step)
        trainer.export(out)
        if _is_reporting_rank():  # the trainer configured logging: this line is in its format
            get_logger("d9d.cli").info(
                "export finished", step=trainer.step, checkpoint=str(info.path.resolve()), out=str(out)
            )


def _is_reporting_rank() -> bool:
    """True on the process that reports (rank 0, or the only process)."""
    return os.environ.get("RANK", "0") == "0"


def committed_checkpoint(
    run_dir: Path, step: int | None, *, best: bool = False, purpose: str = "export"
) -> "CheckpointInfo":
    """The run's committed checkpoint (`CheckpointInfo`) of `step`, its best (`best`) or its latest; a
    `CliError` (saying there is none to `purpose`) if none."""
    if not run_dir.is_dir():
        raise CliError(
            f"run directory {run_dir} does not exist; train the job first (or check trainer.run.name "
            "and trainer.checkpointing.save_dir)"
        )
    committed = scan_run_dir(run_dir).committed
    steps = [info.step for info in committed]
    if not steps:
        raise CliError(f"{run_dir} has no committed checkpoint to {purpose}; train the job first")
    if best:
        from d9d.ckpt import best_checkpoints

        policy = best_policy(committed)
        ranked = best_checkpoints(committed, policy)
        if not ranked:
            raise CliError(
                f"{run_dir} has no checkpoint that records {policy.metric} (only runs with an eval: section "
                "record it); pass --step N or leave out --best for the latest"
            )
        return ranked[0]
    if step is None:
        return committed[-1]
    if step not in steps:
        raise CliError(f"{run_dir} has no committed checkpoint of step {step}; it has steps {steps}")
    return next(info for info in committed if info.step == step)


def loaded_from_run(run_dir: Path, info: "CheckpointInfo", overrides: list[str]) -> "LoadedJob":
    """The job config stored in checkpoint `info`, pointed back at this run directory.

    Reads only the checkpoint's small extra-state file: the weights are loaded once, by the trainer.
    """
    from d9d.ckpt import CheckpointManager
    from d9d.trainer import load_job_config

    with CheckpointManager(run_dir.parent, run_dir.name) as manager:
        extra_state = manager.read_extra_state(info)
    raw = extra_state.get("config")
    if not isinstance(raw, dict):
        raise CliError(
            f"checkpoint {info.path} does not hold the config it was trained with; "
            "export with the config instead: d9d export CONFIG --out DIR"
        )
    stored = extra_state.get("config_dir")
    base, tried = find_config_dir(raw, run_dir, Path.cwd(), stored if isinstance(stored, str) else None)
    files = list(dict.fromkeys(relative_provider_files(raw)))
    if files and base is None:
        raise CliError(
            f"the config stored in {info.path} names {', '.join(files)} relative to its original config "
            f"file, which was not found in (or below) {', '.join(str(t) for t in tried)}; export with "
            "the config instead: d9d export path/to/config.yaml --out DIR"
        )
    # file.py providers and data paths resolve next to the original (here: virtual) config file
    # (with no relative provider file to go by, the first place tried is the best guess for data paths)
    guess = base or (tried[0] if tried else Path.cwd())
    virtual = guess / f"<config stored in {run_dir.name} save-{info.step}>"
    loaded = load_job_config(raw, overrides, config_path=virtual)
    # Point the job at this run directory wherever it was trained.
    pinned = {
        "trainer.checkpointing.save_dir": str(run_dir.resolve().parent),
        "trainer.run.name": run_dir.name,
    }
    return with_values(loaded, pinned)
