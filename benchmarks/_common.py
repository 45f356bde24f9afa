"""Helpers shared by the benchmarks: peak-RSS sampling and the `--json` ratio rows that run_all.py reads.

A benchmark prints its own human-readable table; with `--json PATH` it also writes the ratios it
measured as a list of rows `{"name", "ratio", "ideal", "note"}` (see `Row`), which run_all.py
collects into one table.
"""

import json
import resource
import threading
import time
from pathlib import Path
from typing import TypedDict

MB = 2**20


class Row(TypedDict):
    """One measured ratio: what it is, its value, and the value it would have with no overhead."""

    name: str
    ratio: float
    ideal: str
    note: str


def row(name: str, ratio: float, ideal: str, note: str = "") -> Row:
    return Row(name=name, ratio=ratio, ideal=ideal, note=note)


def write_rows(path: str | None, rows: list[Row]) -> None:
    """Write the rows as JSON when `path` is given (the `--json` option); a no-op otherwise."""
    if path:
        Path(path).write_text(json.dumps(rows, indent=1), encoding="utf-8")


def rss() -> int:
    """This process's resident set size in bytes (anonymous and file-backed pages, e.g. mmapped files)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class PeakSampler:
    """Samples this process's RSS every millisecond (ru_maxrss cannot be reset after a model build)."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
