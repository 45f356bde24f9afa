"""`d9d metrics`: a summary of a run's per-step metrics file, and optionally a plot of it.

Reads only the JSON-lines file the trainer writes, with the trainer's reader
(`d9d.trainer.observe.metrics_file`, no torch import): a damaged line is skipped and counted. A restart shows in the file as
a step that does not follow the previous one (the trainer rewinds to the checkpoint it resumed
from), or, when the records carry a `launch` field, as a change of its value.
"""

import collections
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from d9d.cli.commands._runs import check_run_dir
from d9d.cli.errors import CliError, reports_errors
from d9d.trainer.observe.metrics_file import METRICS_FILE, read_metrics_file

__all__ = [
    "PLOT_INSTALL_HINT",
    "MetricsSummary",
    "find_restarts",
    "metrics",
    "plot_metrics",
    "read_metrics",
    "sparkline",
    "summarize",
]

#: How to install the `plot` extra. In the d9d workspace it is an extra of the d9d-cli member, not of
#: the (virtual) workspace root, so `uv sync --extra plot` and `uv sync --all-extras` alone do not
#: reach it; `--all-packages` makes uv sync every member with the extras asked for, and `--inexact`
#: keeps what is installed already (uv sync removes every package it was not asked for: other extras).
PLOT_INSTALL_HINT = (
    "install it with `uv sync --all-packages --inexact --extra plot` in the d9d workspace "
    "(--inexact keeps the extras you have) or `pip install 'd9d-cli[plot]'`"
)

#: The step phases of a record's step-time breakdown (d9d.trainer.observe.timing), as the summary names them.
_STEP_PHASES = {
    "time_data_s": "data",
    "time_forward_backward_s": "forward+backward",
    "time_optimizer_s": "optimizer",
}


@dataclass(frozen=True)
class MetricsSummary:
    """What `d9d metrics` prints about a run."""

    records: int
    first_step: int
    last_step: int
    first_loss: float
    last_loss: float
    min_loss: float
    min_loss_step: int
    tokens_per_s: float | None
    skipped: int
    restarts: list[tuple[int, int]]  # (step before, step after) of every restart
    breakdown: dict[str, float] | None = None
    """Share of the step time per phase of `_STEP_PHASES`, over the steps that record them (None: none do)."""
    checkpoint_stall_s: float = 0.0
    """The recorded checkpoint stalls (`time_checkpoint_s`) added up."""
    loss_trend: str = ""
    """`sparkline` of the loss over the steps."""
    last_eval: tuple[int, float] | None = None
    """(step, eval_loss) of the last record with a validation loss (None: no eval ran)."""
    busiest: tuple[int, int, int, float] | None = None
    """(rank, steps it was the busiest, steps that record it, the median `straggler_ratio` of its
    steps) of the rank most often the busiest (`straggler_rank`); None on one process."""


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a metrics file in file order, and how many lines were unreadable (skipped)."""
    read = read_metrics_file(path)
    return read.records, len(read.damaged)


def find_restarts(records: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """(previous step, next step) wherever the run was started again.

    A restart is a record whose step is not the previous step + 1, or whose `launch` value (when
    the trainer writes one) differs from the previous record's.
    """
    found = []
    for prev, cur in itertools.pairwise(records):
        relaunched = "launch" in cur and cur.get("launch") != prev.get("launch")
        if cur["step"] != prev["step"] + 1 or relaunched:
            found.append((prev["step"], cur["step"]))
    return found


def summarize(records: Sequence[dict[str, Any]]) -> MetricsSummary:
    """Summarize records in file order; a step recorded twice (after a restart) counts once, as its last record."""
    if not records:
        raise CliError("the metrics file has no records yet")
    by_step = {r["step"]: r for r in records}
    steps = sorted(by_step)
    finite = [(by_step[s]["loss"], s) for s in steps if _finite(by_step[s].get("loss"))]
    if not finite:
        raise CliError("the metrics file has no finite loss")
    min_loss, min_step = min(finite)
    tokens = sum(float(by_step[s].get("tokens", 0.0)) for s in steps)
    seconds = sum(float(by_step[s].get("step_time_s", 0.0)) for s in steps)
    return MetricsSummary(
        records=len(records),
        first_step=steps[0],
        last_step=steps[-1],
        first_loss=finite[0][0],
        last_loss=finite[-1][0],
        min_loss=min_loss,
        min_loss_step=min_step,
        tokens_per_s=tokens / seconds if seconds > 0 and tokens > 0 else None,
        skipped=sum(1 for s in steps if by_step[s].get("skipped")),
        restarts=find_restarts(records),
        breakdown=_breakdown([by_step[s] for s in steps]),
        checkpoint_stall_s=sum(float(by_step[s].get("time_checkpoint_s", 0.0)) for s in steps),
        loss_trend=sparkline([loss for loss, _ in finite]),
        busiest=_busiest([by_step[s] for s in steps]),
        last_eval=next(
            (
                (s, float(by_step[s]["eval_loss"]))
                for s in reversed(steps)
                if _finite(by_step[s].get("eval_loss"))
            ),
            None,
        ),
    )


#: Eight heights of a terminal sparkline, lowest first.
_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """The values as one line of block characters, at most `width` wide (bucket means when longer)."""
    if not values:
        return ""
    buckets = min(width, len(values))
    means = []
    for i in range(buckets):
        part = values[i * len(values) // buckets : (i + 1) * len(values) // buckets]
        means.append(sum(part) / len(part))
    low, high = min(means), max(means)
    if high - low <= 1e-12 * max(abs(high), 1.0):
        return _BARS[3] * buckets
    return "".join(_BARS[min(7, int((m - low) / (high - low) * 8))] for m in means)


def _breakdown(records: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    timed = [r for r in records if all(_finite(r.get(key)) for key in (*_STEP_PHASES, "step_time_s"))]
    total = sum(float(r["step_time_s"]) for r in timed)
    if not timed or total <= 0:
        return None
    return {name: sum(r[key] for r in timed) / total for key, name in _STEP_PHASES.items()}


def _busiest(records: Sequence[dict[str, Any]]) -> tuple[int, int, int, float] | None:
    ranked = [
        r for r in records if isinstance(r.get("straggler_rank"), int) and _finite(r.get("straggler_ratio"))
    ]
    if not ranked:
        return None
    counts = collections.Counter(r["straggler_rank"] for r in ranked)
    rank, count = counts.most_common(1)[0]
    ratio = statistics.median(float(r["straggler_ratio"]) for r in ranked if r["straggler_rank"] == rank)
    return rank, count, len(ranked), ratio


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _format(summary: MetricsSummary, path: Path, bad: int) -> str:
    s = summary
    n = s.last_step - s.first_step + 1
    lines = [
        f"metrics: {path} ({s.records} records"
        + (f", {bad} unreadable line{'s' if bad > 1 else ''} skipped)" if bad else ")"),
        f"steps: {s.first_step}..{s.last_step} ({n} step{'s' if n != 1 else ''})",
        f"loss: first {s.first_loss:.4f}, last {s.last_loss:.4f}, min {s.min_loss:.4f} (step {s.min_loss_step})",
        f"loss trend: {s.loss_trend}",
        *([f"eval loss: {s.last_eval[1]:.4f} (step {s.last_eval[0]})"] if s.last_eval is not None else []),
        "tokens/s: "
        + (
            f"{s.tokens_per_s:,.0f} (total tokens / total step time)"
            if s.tokens_per_s is not None
            else "unknown"
        ),
        *_breakdown_lines(s),
        *(
            [
                f"busiest rank: rank {s.busiest[0]} in {s.busiest[1]} of {s.busiest[2]} steps "
                f"(median {s.busiest[3]:.2f}x the median rank's busy time)"
            ]
            if s.busiest is not None
            else []
        ),
        f"skipped steps: {s.skipped}",
        f"restarts: {len(s.restarts)}"
        + (" (" + ", ".join(f"step {a} → {b}" for a, b in s.restarts) + ")" if s.restarts else ""),
    ]
    return "\n".join(lines)


def _breakdown_lines(s: MetricsSummary) -> list[str]:
    if s.breakdown is None:  # records of a trainer before the breakdown
        return []
    shares = ", ".join(f"{name} {share:.1%}" for name, share in s.breakdown.items())
    return [f"step time: {shares}; checkpoint stalls {s.checkpoint_stall_s:.2f} s"]


def plot_metrics(
    runs: Sequence[tuple[str, Sequence[dict[str, Any]], Iterable[tuple[int, int]]]], out: Path
) -> None:
    """Draw loss, learning rate, grad norm and tokens/s (and the eval loss, when recorded) against
    step into a PNG at `out`; several runs are overlaid, one colour and legend entry each.

    Args:
        runs: (label, records in file order, restarts) per run.

    Raises:
        CliError: when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(
            f"--plot needs matplotlib, which is not installed; {PLOT_INSTALL_HINT}, and run again"
        ) from None
    panels: list[tuple[str, Any]] = [
        ("loss", lambda r: r.get("loss")),
        ("learning rate", lambda r: r.get("lr")),
        ("grad norm", lambda r: r.get("grad_norm")),
        (
            "tokens/s",
            lambda r: r["tokens"] / r["step_time_s"] if r.get("tokens") and r.get("step_time_s") else None,
        ),
    ]
    if any(_finite(r.get("eval_loss")) for _, records, _ in runs for r in records):
        panels.append(("eval loss", lambda r: r.get("eval_loss")))
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(8, 2.2 * len(panels)))
    for index, (label, records, restarts) in enumerate(runs):
        color = f"C{index % 10}"
        by_step = {r["step"]: r for r in records}
        steps = sorted(by_step)
        for ax, (title, value) in zip(axes, panels, strict=True):
            points = [(s, v) for s in steps if _finite(v := value(by_step[s]))]
            style = {"marker": "o", "markersize": 3} if title == "eval loss" else {}
            ax.plot(
                [s for s, _ in points], [v for _, v in points], linewidth=1, color=color, label=label, **style
            )
            for _, after in restarts:
                ax.axvline(after, color=color, linestyle=":", linewidth=1, alpha=0.6)
    for ax, (title, _) in zip(axes, panels, strict=True):
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize="small")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


@click.command(short_help="Summarize (and plot) a run's metrics; several runs to compare them.")
@click.argument("run_dirs", metavar="RUN_DIR...", nargs=-1, required=True, type=click.Path())
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(),
    help="Also draw loss, lr, grad norm and tokens/s (and eval loss) against step into this PNG, "
    "the runs overlaid (needs matplotlib).",
)
@reports_errors
def metrics(run_dirs: tuple[str, ...], plot_path: str | None) -> None:
    """Summarize each RUN_DIR's metrics file (save_dir/run.name/metrics.jsonl).

    Prints the steps, the first, last and lowest loss with a sparkline of it, the last eval loss,
    mean throughput (tokens / step time), where the step time went (data wait, forward+backward,
    optimizer; checkpoint stalls), skipped steps and restarts. A RUN_DIR may also be the metrics
    file itself. With several, each is summarized and the plot overlays them.

    \b
    Examples:
      d9d metrics runs/quickstart
      d9d metrics runs/quickstart --plot quickstart.png
      d9d metrics runs/lr-3e-4 runs/lr-1e-3 --plot compare.png
    """
    runs = []
    for index, run_dir in enumerate(run_dirs):
        path = _metrics_path(Path(run_dir))
        records, bad = read_metrics(path)
        summary = summarize(records)
        click.echo(("\n" if index else "") + _format(summary, path, bad))
        runs.append((_label(path, [Path(r) for r in run_dirs]), records, summary.restarts))
    if plot_path is not None:
        plot_metrics(runs, Path(plot_path))
        click.echo(f"plot: {plot_path}")


def _metrics_path(path: Path) -> Path:
    if path.is_file():
        return path
    found = check_run_dir(path) / METRICS_FILE
    if not found.is_file():
        raise CliError(f"{found.parent} has no {METRICS_FILE}; has the run done a step yet?")
    return found


def _label(path: Path, all_paths: Sequence[Path]) -> str:
    """The run's name (its directory), or its whole path where two runs share a name."""
    name = path.resolve().parent.name
    names = [(p.parent if p.is_file() else p).resolve().name for p in all_paths]
    return name if names.count(name) <= 1 else str(path.parent)
