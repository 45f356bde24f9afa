"""`d9d init`: write a ready-to-run quickstart job (train.py, config.yaml, corpus.txt) into a directory."""

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import click

from d9d.cli.errors import CliError, reports_errors

__all__ = ["TEMPLATE_FILES", "d9d_invocation", "init", "write_quickstart"]

#: Files `d9d init` writes, shipped as package data in `d9d/cli/templates/`.
TEMPLATE_FILES = ("train.py", "config.yaml", "corpus.txt")


def write_quickstart(directory: Path) -> list[Path]:
    """Write the quickstart files into `directory` (created if needed); never overwrites a file.

    Raises:
        CliError: when any of the files already exists (then nothing is written).
    """
    targets = [directory / name for name in TEMPLATE_FILES]
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        raise CliError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
            "d9d init never overwrites files: choose another directory or move them away"
        )
    if directory.exists() and not directory.is_dir():
        raise CliError(f"{directory} is a file, not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    templates = resources.files("d9d.cli").joinpath("templates")
    for target in targets:
        target.write_bytes(templates.joinpath(target.name).read_bytes())
    return targets


def d9d_invocation(environ: Mapping[str, str] | None = None) -> str:
    """How the user's shell runs this same `d9d`: `d9d` when that is the one on its PATH, else a full path.

    Under `uv run` (or from a virtual environment that is not activated) the shell that typed the
    command lacks this environment's `bin` directory on its PATH, so a bare `d9d` would fail or run
    another installation; the path of this environment's `d9d` script works from any directory.
    """
    env = os.environ if environ is None else environ
    script = Path(sys.executable).parent / ("d9d.exe" if os.name == "nt" else "d9d")
    if not script.is_file():  # d9d.cli run from a checkout, not installed as a script
        return f"{shlex.quote(sys.executable)} -m d9d.cli"
    if "UV_RUN_RECURSION_DEPTH" not in env:  # uv run puts the environment on PATH for its child only
        found = shutil.which("d9d", path=env.get("PATH"))
        if found is not None and os.path.samefile(found, script):
            return "d9d"
    return shlex.quote(str(script))


@click.command(short_help="Write a ready-to-run quickstart job.")
@click.argument("directory", type=click.Path(), default=".")
@reports_errors
def init(directory: str) -> None:
    """Write a ready-to-run quickstart job into DIRECTORY (default: the current one).

    It writes train.py (a small GPT-style model and its dataset provider), config.yaml (the job) and
    corpus.txt (public-domain text to train on), and never overwrites an existing file. The job
    needs only the d9d packages. Its model is a starting point to edit: its export holds its own
    module names (no config.json), not a folder transformers loads; for that, start from
    examples/quickstart (the reference model, exported in the Hugging Face layout).

    \b
    Examples:
      d9d init my-job
      cd my-job && d9d train config.yaml
      d9d plan my-job/config.yaml --world-size 4 --set mesh.data_parallel_shard=4
    """
    target = Path(directory)
    written = write_quickstart(target)
    click.echo("wrote " + ", ".join(str(p) for p in written))
    d9d = d9d_invocation()
    cd = "" if target.resolve() == Path.cwd().resolve() else f"cd {shlex.quote(str(target))} && "
    click.echo("next, train it (one process, a few minutes on a CPU):")
    click.echo(f"  {cd}{d9d} train config.yaml")
    click.echo("or check it for 2 processes first (no GPUs needed):")
    click.echo(f"  {cd}{d9d} plan config.yaml --world-size 2 --set mesh.data_parallel_shard=2")
