"""MoE layer: grouped-GEMM experts vs the per-expert loop, and host reads per layer with and without EP.

    OMP_NUM_THREADS=1 uv run python benchmarks/moe.py [--experts 8 64] [--tokens 4096] [--hidden 256]
    OMP_NUM_THREADS=1 uv run python benchmarks/moe.py --tiny      # seconds: the smoke test's size
    python benchmarks/moe.py --device cuda --experts 64 --top-k 8 --tokens 8192 --hidden 2048 --ffn 1408 \
        --uneven --check moe                                        # the GPU check's line (bf16)

One CPU process: a `d9d.parallel.expert.MoE` layer (top-2, SwiGLU experts of width `--ffn`), forward and
backward of a fixed batch of `--tokens` tokens, median of `--repeats` after a warm-up, once with the
bank as grouped GEMMs (`torch.nn.functional.grouped_mm`, offsets on the device) and once as the
per-expert loop it replaces (the fallback, forced). The ratio grouped / loop is measured in the same
run. Host reads (what a CUDA run waits for: `aten._local_scalar_dense`, `bincount`, `nonzero` and
`Tensor.tolist`) are counted per forward+backward of one layer, on one process and, forked, on
expert parallelism 2 over gloo. On a GPU the grouped path is one kernel per matmul instead of one per
expert; CPU times here say only that nothing got slower.

`--uneven` routes unevenly, as a trained router does, with one expert that gets no token: the router's
score bias (as auxiliary-loss-free balancing keeps it) rises from expert to expert, and expert 0's is
out of reach. On CUDA the layer runs in bfloat16 (the grouped kernels' dtype there). `--check NAME`
prints the first expert count's figures as one `RESULT NAME ...` line (the GPU check) and skips EP 2.
"""

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows

from d9d.mesh.testing import HostSyncCounter, run_distributed
from d9d.parallel.expert import MoE, MoEBalancing
from d9d.parallel.expert import experts as experts_module


def _layer(args: argparse.Namespace, experts: int) -> MoE:
    torch.manual_seed(0)
    balancing = MoEBalancing(bias_update_rate=1e-3) if args.uneven else None
    moe = MoE(args.hidden, args.ffn, experts, args.top_k, balancing=balancing)
    if args.uneven:
        assert moe.router.score_bias is not None
        with torch.no_grad():  # probabilities are ~1/experts each: a ramp of 2/experts decides the top-k
            moe.router.score_bias.copy_(torch.linspace(0, 2 / experts, experts))
            moe.router.score_bias[0] = -1.0
    return moe.to(args.device, args.dtype)


def _input(args: argparse.Namespace, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, args.hidden, device=args.device, dtype=args.dtype, requires_grad=True)


def _sync(args: argparse.Namespace) -> None:
    if args.device.type == "cuda":
        torch.cuda.synchronize()


def _step(moe: torch.nn.Module, x: torch.Tensor) -> None:
    moe(x).square().mean().backward()


@contextlib.contextmanager
def _bank(grouped: bool) -> Iterator[None]:
    """The experts as grouped GEMMs, or as the per-expert loop (as where torch lacks grouped GEMMs)."""
    saved = experts_module._GROUPED_MM
    if not grouped:
        experts_module._GROUPED_MM = None
    try:
        yield
    finally:
        experts_module._GROUPED_MM = saved


def _median_s(args: argparse.Namespace, experts: int, *, grouped: bool) -> tuple[float, torch.Tensor]:
    """Median forward + backward seconds, and the layer's output on the timed batch."""
    with _bank(grouped):
        moe = _layer(args, experts)
        torch.manual_seed(1)
        x = _input(args, args.tokens)
        _step(moe, x)  # warm-up
        times = []
        for _ in range(args.repeats):
            _sync(args)
            began = time.perf_counter()
            _step(moe, x)
            _sync(args)
            times.append(time.perf_counter() - began)
        with torch.no_grad():
            return statistics.median(times), moe(x)


def _reads_one_process(args: argparse.Namespace, experts: int, *, grouped: bool = True) -> int:
    with _bank(grouped):
        moe = _layer(args, experts)
        x = _input(args, 64)
        with HostSyncCounter() as reads:
            _step(moe, x)
    return reads.count


def _routing(args: argparse.Namespace, experts: int) -> str:
    """Tokens per expert of the timed batch: least, most, and how many experts got none."""
    moe = _layer(args, experts)
    torch.manual_seed(1)
    with torch.no_grad():
        moe(_input(args, args.tokens))
    assert moe.last_stats is not None
    counts = moe.last_stats.tokens_per_expert.tolist()
    return f"tokens/expert min {min(counts):.0f} max {max(counts):.0f} empty {sum(c == 0 for c in counts)}"


def _check(args: argparse.Namespace, name: str) -> None:
    """The GPU check's line: grouped vs loop time and output, host reads of each, the routing."""
    experts = args.experts[0]
    grouped, out_grouped = _median_s(args, experts, grouped=True)
    loop, out_loop = _median_s(args, experts, grouped=False)
    gap = ((out_grouped.float() - out_loop.float()).abs().max() / out_loop.float().abs().max()).item()
    good = gap < (2e-2 if args.dtype == torch.bfloat16 else 1e-4)
    reads = (_reads_one_process(args, experts), _reads_one_process(args, experts, grouped=False))
    print(f"RESULT {name} {'PASS' if good else 'FAIL'} {experts} experts top-{args.top_k}, {args.tokens} tokens, "
          f"hidden {args.hidden}, ffn {args.ffn}, {str(args.dtype).removeprefix('torch.')}: grouped {grouped * 1e3:.2f} ms "
          f"loop {loop * 1e3:.2f} ms grouped/loop {grouped / loop:.3f} output rel gap {gap:.1e} host reads "
          f"grouped {reads[0]} loop {reads[1]} {_routing(args, experts)}", flush=True)  # fmt: skip


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
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--uneven", action="store_true", help="uneven routing with an empty expert")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    parser.add_argument("--tiny", action="store_true", help="a few seconds: 64 tokens, hidden 32")
    parser.add_argument("--check", metavar="NAME", help="print one RESULT NAME line (no EP 2)")
    parser.add_argument("--json", help="write the ratios here (for run_all.py)")
    args = parser.parse_args()
    if args.tiny:
        args.experts, args.tokens, args.hidden, args.ffn, args.repeats = [8], 64, 32, 64, 2
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    if args.check:
        _check(args, args.check)
        return
    rows = []
    print(
        f"MoE layer, top-{args.top_k}, {args.tokens} tokens, hidden {args.hidden}, expert ffn {args.ffn}, fwd+bwd"
    )
    print(
        f"{'experts':>8} {'grouped ms':>11} {'loop ms':>9} {'grouped/loop':>13} {'host reads 1 proc':>18} {'EP 2':>5}"
    )
    for experts in args.experts:
        grouped, _ = _median_s(args, experts, grouped=True)
        loop, _ = _median_s(args, experts, grouped=False)
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
