"""MoE layer: grouped-GEMM experts vs the per-expert loop, and host reads per layer with and without EP.

    OMP_NUM_THREADS=1 uv run python benchmarks/moe.py [--experts 8 64] [--tokens 4096] [--hidden 256]
    OMP_NUM_THREADS=1 uv run python benchmarks/moe.py --tiny      # seconds: the smoke test's size

One CPU process: a `d9d.parallel.expert.MoE` layer (top-2, SwiGLU experts of width `--ffn`), forward and
backward of a fixed batch of `--tokens` tokens, median of `--repeats` after a warm-up, once with the
bank as grouped GEMMs (`torch.nn.functional.grouped_mm`, offsets on the device) and once as the
per-expert loop it replaces (the fallback, forced). The ratio grouped / loop is measured in the same
run. Host reads (what a CUDA run waits for: `aten._local_scalar_dense`, `bincount`, `nonzero` and
`Tensor.tolist`) are counted per forward+backward of one layer, on one process and, forked, on
expert parallelism 2 over gloo. On a GPU the grouped path is one kernel per matmul instead of one per
expert; CPU times here say only that nothing got slower.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows

from d9d.mesh.testing import HostSyncCounter, run_distributed
from d9d.parallel.expert import MoE
from d9d.parallel.expert import experts as experts_module


def _layer(args: argparse.Namespace, experts: int) -> MoE:
    torch.manual_seed(0)
    return MoE(args.hidden, args.ffn, experts, 2)


def _step(moe: torch.nn.Module, x: torch.Tensor) -> None:
    moe(x).square().mean().backward()


def _median_s(args: argparse.Namespace, experts: int, *, grouped: bool) -> float:
    saved = experts_module._GROUPED_MM
    if not grouped:
        experts_module._GROUPED_MM = None  # the per-expert loop, as where torch lacks grouped GEMMs
    try:
        moe = _layer(args, experts)
        x = torch.randn(args.tokens, args.hidden, requires_grad=True)
        _step(moe, x)  # warm-up
        times = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            _step(moe, x)
            times.append(time.perf_counter() - began)
        return statistics.median(times)
    finally:
        experts_module._GROUPED_MM = saved


def _reads_one_process(args: argparse.Namespace, experts: int) -> int:
    moe = _layer(args, experts)
    with HostSyncCounter() as reads:
        _step(moe, torch.randn(64, args.hidden, requires_grad=True))
    return reads.count


def _reads_ep2(hidden: int, ffn: int, experts: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from d9d.parallel.expert import parallelize_expert_parallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(hidden, ffn, experts, 2))
    parallelize_expert_parallel(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep_shard",)))
    with HostSyncCounter() as reads:
        _step(model, torch.randn(64, hidden, requires_grad=True))
    return reads.count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a few seconds: 64 tokens, hidden 32")
    parser.add_argument("--json", help="write the ratios here (for run_all.py)")
    args = parser.parse_args()
    if args.tiny:
        args.experts, args.tokens, args.hidden, args.ffn, args.repeats = [8], 64, 32, 64, 2
    rows = []
    print(f"MoE layer, top-2, {args.tokens} tokens, hidden {args.hidden}, expert ffn {args.ffn}, fwd+bwd")
    print(
        f"{'experts':>8} {'grouped ms':>11} {'loop ms':>9} {'grouped/loop':>13} {'host reads 1 proc':>18} {'EP 2':>5}"
    )
    for experts in args.experts:
        grouped = _median_s(args, experts, grouped=True)
        loop = _median_s(args, experts, grouped=False)
        local = _reads_one_process(args, experts)
        ep = run_distributed(_reads_ep2, 2, args.hidden, args.ffn, experts, timeout=300)[0]
        print(
            f"{experts:>8} {grouped * 1e3:>11.1f} {loop * 1e3:>9.1f} {grouped / loop:>13.2f} {local:>18} {ep:>5}"
        )
        rows.append(row(f"moe grouped/loop, {experts} experts", grouped / loop, "<= 1 (GPU: far below)"))
        rows.append(row(f"moe host reads per layer, 1 process, {experts} experts", float(local), "0"))
        rows.append(
            row(f"moe host reads per layer, EP 2, {experts} experts", float(ep), "1 (the split sizes)")
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
