"""Samples/s of AutoDataProvider against a plain torch DataLoader over the same dataset and batch size.

    uv run python benchmarks/data_loading.py [--seq-len 512] [--samples 20000] [--workers 0 2]

Both read the same memory-mapped token file with the same microbatch size and shuffling; the ratio
(AutoDataProvider / DataLoader) shows the provider's own overhead (global order, rank slices, steps).
A ratio near 1.0 means data loading costs what a DataLoader costs. CPU timings are noisy (±15%).
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import Row, row, write_rows
from torch.utils.data import DataLoader

from d9d.data import AutoDataConfig, AutoDataProvider, TokenFileDataset


def _time_provider(dataset, gbs, mbs, workers, samples):
    config = AutoDataConfig(global_batch_size=gbs, microbatch_size=mbs, num_workers=workers, seed=0)
    with AutoDataProvider(config, dataset) as provider:
        next(provider)  # start-up (workers) is not throughput
        start, seen = time.perf_counter(), 0
        while seen < samples:
            for mb in next(provider):
                seen += mb["input_ids"].shape[0]
        return seen / (time.perf_counter() - start)


def _time_dataloader(dataset, mbs, workers, samples):
    loader = DataLoader(
        dataset,
        batch_size=mbs,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    while True:
        iterator = iter(loader)
        next(iterator)
        start, seen = time.perf_counter(), 0
        for batch in iterator:
            seen += batch["input_ids"].shape[0]
            if seen >= samples:
                return seen / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=20_000, help="samples timed per run")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        num_tokens = 2 * args.samples * args.seq_len + 1
        np.random.default_rng(0).integers(0, 50_000, size=num_tokens, dtype=np.uint16).tofile(path)
        dataset = TokenFileDataset(path, seq_len=args.seq_len, dtype="uint16")
        print(
            f"dataset: {len(dataset):,} samples of {args.seq_len} tokens (memory-mapped uint16); "
            f"global batch {args.global_batch_size}, microbatch {args.microbatch_size}, "
            f"{args.samples:,} samples timed, best of {args.repeats}"
        )
        for workers in args.workers:
            ours, plain = 0.0, 0.0
            for _ in range(args.repeats):  # interleaved, so both see the same machine load and page cache
                ours = max(
                    ours,
                    _time_provider(
                        dataset, args.global_batch_size, args.microbatch_size, workers, args.samples
                    ),
                )
                plain = max(plain, _time_dataloader(dataset, args.microbatch_size, workers, args.samples))
            print(
                f"num_workers={workers}: AutoDataProvider {ours:,.0f} samples/s, DataLoader {plain:,.0f} "
                f"samples/s, ratio {ours / plain:.2f}"
            )
            rows.append(
                row(
                    f"AutoDataProvider / DataLoader samples/s, {workers} workers",
                    ours / plain,
                    "1",
                    f"{ours:,.0f} vs {plain:,.0f} samples/s",
                )
            )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
