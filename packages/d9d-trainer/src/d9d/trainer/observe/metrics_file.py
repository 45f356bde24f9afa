"""`metrics.jsonl`: a run's per-step records, one JSON object per line, and the one way to read it.

The trainer appends the records (`d9d.trainer.observe.records`), resume cuts them back to the checkpoint's
step (`truncate_metrics`) and `d9d metrics` summarizes them; all read with `read_metrics_file`, so
one damage rule holds everywhere: a line that is not a JSON object with an integer `step` (a write
cut short by a crash or a full disk, garbage) is damaged, skipped and counted, and every other line
is a record, in file order. No torch here: `d9d metrics` imports this module alone.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "MetricsFile", "read_metrics", "read_metrics_file", "truncate_metrics"]

#: Per-step metrics of a run, one JSON object per line, in `save_dir/run.name/`.
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class MetricsFile:
    """What a metrics file holds.

    Attributes:
        records: the step records, in file order (a step redone after a restart appears again).
        lines: each record's line as written, for rewriting the file without re-encoding it.
        damaged: the line numbers (1-based) of damaged lines, which are left out of `records`.
    """

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)


def read_metrics_file(path: Path) -> MetricsFile:
    """The records of a metrics file and its damaged lines (a missing file holds none of either)."""
    result = MetricsFile()
    if not path.exists():
        return result
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            result.damaged.append(number)
            continue
        result.records.append(record)
        result.lines.append(line)
    return result


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics file, in file order; damaged lines are left out."""
    return read_metrics_file(path).records


def truncate_metrics(path: Path, step: int) -> list[int]:
    """Keep the records of steps up to `step` (later ones were lost with the crash and are redone).

    Damaged lines are dropped too (never a reason to fail); their line numbers are returned for the
    caller to report. The file is replaced atomically.
    """
    if not path.exists():
        return []
    read = read_metrics_file(path)
    kept = [line for line, record in zip(read.lines, read.records, strict=True) if record["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return read.damaged
