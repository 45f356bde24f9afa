"""`d9d init`: write a ready-to-run quickstart job (train.py, config.yaml, corpus.txt) into a directory."""

from importlib import resources
from pathlib import Path

import click

from d9d.cli.errors import CliError, reports_errors

__all__ = ["TEMPLATE_FILES", "init", "write_quickstart"]

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


@click.command(short_help="Write a ready-to-run quickstart job.")
@click.argument("directory", type=click.Path(), default=".")
@reports_errors
def init(directory: str) -> None:
    """Write a ready-to-run quickstart job into DIRECTORY (default: the current one).

    It writes train.py (a small GPT-style model and its dataset provider), config.yaml (the job) and
    corpus.txt (public-domain text to train on), and never overwrites an existing file. The job
    needs only the d9d packages.

    \b
    Examples:
      d9d init my-job
      cd my-job && d9d train config.yaml
      d9d plan my-job/config.yaml --world-size 4 --set mesh.data_parallel_shard=4
    """
    target = Path(directory)
    written = write_quickstart(target)
    config = target / "config.yaml"
    click.echo("wrote " + ", ".join(str(p) for p in written))
    click.echo("next:")
    click.echo(f"  d9d train {config}                # one process, a few minutes on a CPU")
    click.echo(f"  d9d plan {config} --world-size 2 --set mesh.data_parallel_shard=2")
