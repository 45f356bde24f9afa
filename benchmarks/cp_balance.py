"""Context parallelism over packed rows: the attention work (query-key pairs) of the most loaded cp
rank over the mean, with the load-balanced layout as it is and after reordering whole documents.

    OMP_NUM_THREADS=1 uv run python benchmarks/cp_balance.py [--seq 8192] [--batches 32] [--quick]

Pure arithmetic, no model and no processes: the pairs are `d9d.parallel.attention_pairs_per_rank`
(exact, tested against the mask written out). Rows are packed with document lengths drawn from a
lognormal (median `--median` tokens, sigma `--sigma`), the long-tailed lengths of chat and code; the
"long" scenarios also put one long document (a quarter or half of the row) at the row's end, where it
loads rank 0 most. For every cp and rows per microbatch (one attention call: the ranks wait for its
slowest), the mean and the worst max/mean over `--batches` microbatches: `before` the rows as packed,
`after` `balanced_document_order` (the trainer's `trainer.attention.balance_documents`), and `per-doc`
a layout that cuts every document into 2·cp pieces and mirrors them (not d9d's; what would balance a
single row whose long document dominates). `reorder_ms` is the host time of the reordering per
microbatch.
"""

import argparse
import statistics
import time

import torch
from _common import row, write_rows

from d9d.parallel import attention_pairs_per_rank, balance_ratio, balanced_document_order

SCENARIOS = {"lognormal": None, "long 1/4": 4, "long 1/2": 2}


def _row(seq: int, gen: torch.Generator, median: float, sigma: float, long_part: int | None) -> torch.Tensor:
    """Document ids of one packed row of `seq` tokens; with `long_part`, a last document of seq / long_part."""
    last = seq // long_part if long_part else 0
    lengths = []
    while sum(lengths) < seq - last:
        length = float(torch.empty(1).log_normal_(float(torch.tensor(median).log()), sigma, generator=gen))
        lengths.append(max(1, int(length)))
    lengths[-1] -= sum(lengths) - (seq - last)
    if last:
        lengths.append(last)
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([n for n in lengths if n > 0]))


def _per_document_pairs(ids: torch.Tensor, cp: int) -> torch.Tensor:
    """Pairs per rank if each document were cut into 2·cp pieces, piece j on rank min(j, 2·cp−1−j)."""
    loads = torch.zeros(cp, dtype=torch.int64)
    for r in ids:
        lengths = torch.unique_consecutive(r, return_counts=True)[1]
        for n in lengths.tolist():
            i = torch.arange(n)
            piece = i * 2 * cp // n
            loads.index_add_(0, torch.minimum(piece, 2 * cp - 1 - piece), i + 1)
    return loads


def measure(
    seq: int, cp: int, rows: int, batches: int, long_part: int | None, args: argparse.Namespace
) -> dict:
    gen = torch.Generator().manual_seed(seq + cp * 100 + rows + (long_part or 0))
    before, after, per_doc, times = [], [], [], []
    for _ in range(batches):
        ids = torch.stack([_row(seq, gen, args.median, args.sigma, long_part) for _ in range(rows)])
        began = time.perf_counter()
        index = balanced_document_order(ids, cp)
        times.append(time.perf_counter() - began)
        before.append(balance_ratio(attention_pairs_per_rank(ids, cp)))
        after.append(balance_ratio(attention_pairs_per_rank(torch.gather(ids, 1, index), cp)))
        per_doc.append(balance_ratio(_per_document_pairs(ids, cp)))
    return {
        "before": statistics.mean(before), "before_worst": max(before),
        "after": statistics.mean(after), "after_worst": max(after),
        "per_doc": statistics.mean(per_doc), "reorder_ms": 1e3 * statistics.median(times),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows per microbatch")
    parser.add_argument("--batches", type=int, default=32)
    parser.add_argument("--median", type=float, default=256.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="seq 512, 2 batches (the smoke test)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.seq, args.batches, args.median = 512, 2, 32.0
    print(
        f"seq {args.seq}, lognormal median {args.median:g} sigma {args.sigma:g}, {args.batches} microbatches each"
    )
    print(
        f"{'scenario':<10} {'cp':>3} {'rows':>4} {'before':>7} {'worst':>7} {'after':>7} {'worst':>7} {'per-doc':>8} {'ms':>6}"
    )
    out = []
    for scenario, long_part in SCENARIOS.items():
        for cp in args.cp:
            for rows in args.rows:
                m = measure(args.seq, cp, rows, args.batches, long_part, args)
                print(
                    f"{scenario:<10} {cp:>3} {rows:>4} {m['before']:>7.3f} {m['before_worst']:>7.3f} "
                    f"{m['after']:>7.3f} {m['after_worst']:>7.3f} {m['per_doc']:>8.3f} {m['reorder_ms']:>6.1f}"
                )
                name = f"cp_balance {scenario} cp{cp} rows{rows}"
                note = f"worst {m['before_worst']:.3f} -> {m['after_worst']:.3f}; {m['reorder_ms']:.1f} ms"
                out.append(row(f"{name} before", m["before"], "1"))
                out.append(row(f"{name} after", m["after"], "<= 1.15", note))
    write_rows(args.json, out)


if __name__ == "__main__":
    main()
