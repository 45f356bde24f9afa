"""`d9d checkpoints`: the checkpoints of a run, and the directories that are not (yet) checkpoints."""

import datetime

import click

from d9d.cli.commands._runs import RunScan, best_policy, check_run_dir, scan_run_dir
from d9d.cli.commands._text import format_size
from d9d.cli.errors import reports_errors

__all__ = ["EXIT_DAMAGED", "checkpoints", "format_mesh", "format_time"]

#: Exit status of `d9d checkpoints --verify` when any committed checkpoint is damaged.
EXIT_DAMAGED = 1

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
@click.option(
    "--verify",
    is_flag=True,
    help="Read every file and compare it with the checksum its commit recorded; exit 1 if any is damaged.",
)
@reports_errors
def checkpoints(run_dir: str, verify: bool) -> None:
    """List the committed checkpoints of RUN_DIR (save_dir/run.name) and flag the others.

    For each committed `save-<step>`: step, when it was saved (UTC), its size on disk, the world size
    and mesh degrees of the job that wrote it, and whether its files are intact (their sizes; with
    --verify their checksums too, which reads the whole checkpoint). Unfinished saves (no commit
    marker) and leftovers of crashed saves are listed after the table; they are never loaded and are
    safe to delete. When the commit records hold eval numbers, a column shows the metric the run's
    `trainer.checkpointing.keep_best` ranks by (default eval_loss, lower is better) and marks the
    best ones (`best 1` is what `d9d export --best` exports).

    \b
    Examples:
      d9d checkpoints runs/quickstart
      d9d checkpoints --verify runs/quickstart
    """
    scan = scan_run_dir(check_run_dir(run_dir))
    damage = _verify(scan) if verify else {}
    lines = [f"run: {scan.run_dir}"]
    lines += _table(scan, damage) if scan.committed else ["no committed checkpoints"]
    if scan.strays:
        lines.append("not checkpoints:")
        width = max(len(s.path.name) for s in scan.strays) + 1
        lines += [f"  {(s.path.name + '/').ljust(width)}  {s.reason}" for s in scan.strays]
    for step, problems in damage.items():
        lines.append(f"save-{step} is damaged:")
        lines += [f"  {p}" for p in problems]
    if verify:
        lines.append(f"verified {len(scan.committed)} checkpoint(s): {len(damage)} damaged")
    click.echo("\n".join(lines))
    if damage:
        raise SystemExit(EXIT_DAMAGED)


def _verify(scan: RunScan) -> dict[int, list[str]]:
    """Check every committed checkpoint's checksums: {step: problem lines} of the damaged ones.

    A checkpoint whose commit recorded no checksums gets the status `ok (no checksums: sizes only)` in
    `scan.damaged` (unless its sizes already failed), so the table says how little was checked.
    """
    from d9d.ckpt import verify_checkpoint

    damage: dict[int, list[str]] = {}
    for info in scan.committed:
        result = verify_checkpoint(info)
        if not result.ok:
            damage[info.step] = [*result.problems, str(result.recovery)]
        elif not result.has_checksums:
            scan.damaged.setdefault(info.step, "ok (no checksums: sizes only)")
    return damage


def _table(scan: RunScan, damage: dict[int, list[str]]) -> list[str]:
    """The committed checkpoints as aligned rows under a header (with the keep-best metric if recorded)."""
    from d9d.ckpt import best_checkpoints, metric_of  # torch-free: commit records only

    policy = best_policy(scan.committed)
    ranks = {info.step: n for n, info in enumerate(best_checkpoints(scan.committed, policy), 1)}
    shown = any(metric_of(info, policy.metric) is not None for info in scan.committed)
    header = ("step", "saved at (UTC)", "size", "world size", "mesh", "status")
    rows = [(*header, *([policy.metric] if shown else []))]
    for info in scan.committed:
        meta = info.meta
        value = metric_of(info, policy.metric)
        cell = (
            "-"
            if value is None
            else f"{value:.5g}" + (f"  best {ranks[info.step]}" if info.step in ranks else "")
        )
        rows.append(
            (
                str(info.step),
                format_time(meta.created_at),
                format_size(sum(meta.files.values())),
                str(meta.world_size),
                format_mesh(meta.mesh),
                "damaged" if info.step in damage else scan.damaged.get(info.step, "ok"),
                *([cell] if shown else []),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in (0, 2, 3) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
