"""`d9d checkpoints`: the checkpoints of a run, and the directories that are not (yet) checkpoints."""

import datetime

import click

from d9d.cli.commands._runs import check_run_dir, scan_run_dir
from d9d.cli.commands._text import format_size
from d9d.cli.errors import reports_errors

__all__ = ["checkpoints", "format_mesh", "format_time"]

_DEGREE_TAGS = {
    "pipeline_parallel": "pp",
    "data_parallel_replicate": "dp_replicate",
    "data_parallel_shard": "dp_shard",
    "context_parallel": "cp",
    "tensor_parallel": "tp",
    "expert_parallel": "ep",
}


def format_time(created_at: str) -> str:
    """An ISO time stamp from a commit marker as `YYYY-MM-DD HH:MM:SS` UTC (unchanged if unparsable)."""
    try:
        stamp = datetime.datetime.fromisoformat(created_at)
    except ValueError:
        return created_at
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(datetime.UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S")


def format_mesh(mesh: dict[str, int] | None) -> str:
    """The degrees that are not 1 (`dp_shard=2 tp=2`), `1 process` when all are, `?` when unknown."""
    if mesh is None:
        return "?"
    parts = [f"{_DEGREE_TAGS.get(k, k)}={v}" for k, v in mesh.items() if v != 1]
    return " ".join(parts) if parts else "all 1"


@click.command(short_help="List a run's checkpoints; flag unfinished ones.")
@click.argument("run_dir", type=click.Path())
@reports_errors
def checkpoints(run_dir: str) -> None:
    """List the committed checkpoints of RUN_DIR (save_dir/run.name) and flag the others.

    For each committed `save-<step>`: step, when it was saved (UTC), its size on disk, the world size
    and mesh degrees of the job that wrote it, and whether its files are intact. Unfinished saves
    (no commit marker) and leftovers of crashed saves are listed after the table; they are never
    loaded and are safe to delete.

    \b
    Examples:
      d9d checkpoints runs/quickstart
    """
    scan = scan_run_dir(check_run_dir(run_dir))
    lines = [f"run: {scan.run_dir}"]
    if not scan.committed:
        lines.append("no committed checkpoints")
    else:
        rows = [("step", "saved at (UTC)", "size", "world size", "mesh", "status")]
        for info in scan.committed:
            meta = info.meta
            rows.append(
                (
                    str(info.step),
                    format_time(meta.created_at),
                    format_size(sum(meta.files.values())),
                    str(meta.world_size),
                    format_mesh(meta.mesh),
                    scan.damaged.get(info.step, "ok"),
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [
                cell.rjust(w) if i in (0, 2, 3) else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells).rstrip())
    if scan.strays:
        lines.append("not checkpoints:")
        width = max(len(s.path.name) for s in scan.strays) + 1
        lines += [f"  {(s.path.name + '/').ljust(width)}  {s.reason}" for s in scan.strays]
    click.echo("\n".join(lines))
