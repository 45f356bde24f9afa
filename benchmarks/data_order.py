"""Memory and time to fetch one global batch deep into an epoch: d9d's O(1) order vs a full permutation.

    uv run python benchmarks/data_order.py [--samples 2e9] [--position 1e9] [--old-samples 1e8]

d9d computes the dataset indices of a global batch's positions with a keyed Feistel bijection
(`d9d.data.epoch_order(n, seed=, epoch=).indices(positions)`); the old path (d9d-data data state
version 1) built `numpy.random.Generator(PCG64(SeedSequence([seed, epoch]))).permutation(n)` per epoch on
every rank and indexed it. The old path cannot run at 2e9 samples here (16 GB of int64 per rank), so it
is measured at `--old-samples` and extrapolated linearly to `--samples` (its memory is exactly 8 bytes
per sample; its time grows at least linearly). Each measurement runs in a fresh subprocess: the peak
RSS above the baseline (sampled every millisecond) and the tracemalloc peak (numpy reports its buffers
to tracemalloc), then the median wall time of fresh fetches (order built + batch fetched; 100 for
d9d, `--repeats` for the permutation), and of 100 fetches from the cached permutation (what the later
steps of an epoch cost on the old path).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from _common import MB, PeakSampler, Row, row, rss, write_rows

from d9d.data import epoch_order, step_sample_indices

SEED, EPOCH = 0, 3


def _fetch_d9d(n: int, position: int, gbs: int) -> np.ndarray:
    return step_sample_indices(epoch_order(n, seed=SEED, epoch=EPOCH), position, 0, gbs)


def _fetch_permutation(n: int, position: int, gbs: int) -> np.ndarray:
    # The order before d9d-data data state version 2, materialized per epoch on every rank.
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([SEED, EPOCH])))
    order = rng.permutation(n).astype(np.int64, copy=False)
    return order[(position + np.arange(gbs, dtype=np.int64)) % n]


PATHS: dict[str, Callable[[int, int, int], np.ndarray]] = {
    "d9d": _fetch_d9d,
    "permutation": _fetch_permutation,
}


def _measure(path: str, n: int, position: int, gbs: int, repeats: int) -> dict[str, float]:
    """In this (fresh) process: peak RSS delta, tracemalloc peak and median fetch seconds."""
    fetch = PATHS[path]
    _fetch_d9d(64, 0, 8)  # imports and first-call set-up are not the fetch
    base = rss()
    with PeakSampler() as sampler:
        batch = fetch(n, position, gbs)
    rss_delta = max(0, sampler.peak - base)
    assert len(np.unique(batch)) == gbs and int(batch.min()) >= 0 and int(batch.max()) < n
    del batch
    tracemalloc.start()
    fetch(n, position, gbs)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fetch(n, position, gbs)
        seconds.append(time.perf_counter() - start)
    result = {"rss_delta": rss_delta, "traced": traced, "seconds": statistics.median(seconds)}
    if path == "permutation":  # later batches of the epoch only index the cached permutation
        order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([SEED, EPOCH]))).permutation(n)
        steady = []
        for _ in range(100):
            start = time.perf_counter()
            order[(position + np.arange(gbs, dtype=np.int64)) % n]
            steady.append(time.perf_counter() - start)
        result["steady_seconds"] = statistics.median(steady)
    return result


def _in_subprocess(path: str, n: int, position: int, gbs: int, repeats: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--_measure", path, str(n), str(position), str(gbs), str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt_bytes(value: float) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.1f} GiB"
    if value >= MB:
        return f"{value / MB:.1f} MiB"
    return f"{value / 1024:.1f} KiB"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_measure":
        path, n, position, gbs, repeats = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(_measure(path, n, position, gbs, repeats)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=float, default=2e9, help="dataset length for d9d's order")
    parser.add_argument("--position", type=float, default=1e9, help="position of the global batch")
    parser.add_argument(
        "--old-samples", type=float, default=1e8, help="dataset length the permutation runs at"
    )
    parser.add_argument("--global-batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="timed permutation builds (d9d: 100 fetches)")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    n, position, old_n, gbs = (
        int(args.samples),
        int(args.position),
        int(args.old_samples),
        args.global_batch_size,
    )
    old_position = min(position, old_n // 2)
    scale = n / old_n

    ours = _in_subprocess("d9d", n, position, gbs, 100)
    ours_small = _in_subprocess("d9d", old_n, old_position, gbs, 100)
    old = _in_subprocess("permutation", old_n, old_position, gbs, args.repeats)
    old_bytes_n = 8 * n  # the permutation alone: one int64 per sample
    old_seconds_n = old["seconds"] * scale

    print(f"global batch of {gbs:,} samples; seed {SEED}, epoch {EPOCH}; fresh subprocess per measurement")
    header = (
        f"{'path':<34} {'samples':>14} {'position':>14} {'RSS delta':>10} {'tracemalloc':>12} {'fetch':>10}"
    )
    print(header)
    for name, m, size, pos in (
        ("d9d Feistel order", ours, n, position),
        ("d9d Feistel order", ours_small, old_n, old_position),
        ("full permutation (old)", old, old_n, old_position),
    ):
        print(
            f"{name:<34} {size:>14,} {pos:>14,} {_fmt_bytes(m['rss_delta']):>10} "
            f"{_fmt_bytes(m['traced']):>12} {m['seconds'] * 1e3:>8.2f} ms"
        )
    print(
        f"{'full permutation, extrapolated':<34} {n:>14,} {position:>14,} {'':>10} "
        f"{_fmt_bytes(old_bytes_n):>12} {old_seconds_n * 1e3:>8.0f} ms   (8 bytes/sample; time x{scale:g})"
    )
    per_sample_ns = ours["seconds"] / gbs * 1e9
    print(
        f"d9d: {per_sample_ns:.0f} ns per sample, every fetch; the permutation path pays its build once per "
        f"epoch, then {old['steady_seconds'] * 1e3:.3f} ms per global batch from the cached permutation"
    )

    memory_ratio = ours["traced"] / old_bytes_n
    time_ratio = ours["seconds"] / old_seconds_n
    small_memory = ours_small["traced"] / old["traced"]
    small_time = ours_small["seconds"] / old["seconds"]
    print(
        f"ratios d9d / permutation: memory at {n:.0e} samples {memory_ratio:.1e}, first fetch of an epoch "
        f"{time_ratio:.1e} (extrapolated); measured at {old_n:.0e}: memory {small_memory:.1e}, time {small_time:.1e}"
    )
    rows: list[Row] = [
        row(
            f"data order memory at {n:.0e} samples: d9d / permutation",
            memory_ratio,
            "-> 0 (O(1))",
            f"{_fmt_bytes(ours['traced'])} traced vs 8 B x n = {_fmt_bytes(old_bytes_n)}",
        ),
        row(
            f"data order first fetch at {n:.0e}: d9d / permutation",
            time_ratio,
            "-> 0",
            f"{ours['seconds'] * 1e3:.2f} ms vs ~{old_seconds_n:.0f} s (extrapolated x{scale:g})",
        ),
        row(
            f"data order memory at {old_n:.0e} (measured): d9d / permutation",
            small_memory,
            "-> 0",
            f"{_fmt_bytes(ours_small['traced'])} vs {_fmt_bytes(old['traced'])} traced",
        ),
        row(
            f"data order first fetch at {old_n:.0e} (measured): d9d / permutation",
            small_time,
            "-> 0",
            f"{ours_small['seconds'] * 1e3:.2f} ms vs {old['seconds'] * 1e3:.0f} ms; gbs {gbs}",
        ),
    ]
    rows.append(
        row(
            "data order later fetches in an epoch: d9d / cached permutation",
            ours["seconds"] / old["steady_seconds"],
            "(cost of O(1) memory)",
            f"{ours['seconds'] * 1e3:.2f} vs {old['steady_seconds'] * 1e3:.3f} ms per global batch",
        )
    )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
