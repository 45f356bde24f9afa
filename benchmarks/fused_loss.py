"""The fused LM head + cross-entropy (`d9d.parallel.linear_cross_entropy`, `trainer.loss.fused`) against
the full logits (`F.cross_entropy(logits.float(), labels, reduction="sum")`, the built-in task's loss
before it): the peak bytes and the time of one loss step (head forward, loss, backward).

    OMP_NUM_THREADS=1 uv run python benchmarks/fused_loss.py [--tokens 2048] [--hidden 1024]
        [--vocab 128256] [--chunk 256] [--dtype float32] [--repeats 3] [--json rows.json]

Peak bytes: torch's CPU memory profiler (`profile_memory=True`) records every allocation and free of
the step with its size; summed in time order, their running total's maximum is the step's peak above
what existed before it (the hidden states, the head's weight and the labels): exact, not sampled. Both
paths allocate the weight's gradient ([vocab, hidden] float32) inside the step; the rest of the full
path's peak is its [tokens, vocab] logits, log-softmax and their gradient, the fused path's one chunk.
Time: the median over `--repeats` of fused / full step times measured alternately (after one warm-up
of each), outside the profiler. The fused path runs one more head matmul (the backward's recompute).

The shape: the Llama-3 vocabulary (128,256) with fewer tokens and a narrower hidden size than the 8B
shape (8,192 × 4,096) so that a 2-core CPU runs it in about a minute; the chunk is cut in proportion
(8 chunks per step, as 1,024-token chunks at 8,192 tokens). `--tiny` is the smoke test.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import row, write_rows
from torch.profiler import ProfilerActivity, profile

from d9d.parallel import linear_cross_entropy


def _inputs(tokens: int, hidden: int, vocab: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[: tokens // 16] = -100  # a prompt that adds nothing
    return {
        "hidden": (torch.randn(tokens, hidden, generator=g) * 0.5).to(dtype).requires_grad_(),
        "weight": (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_(),
        "labels": labels,
    }


def _full(inputs: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    del chunk
    logits = F.linear(inputs["hidden"], inputs["weight"])
    return F.cross_entropy(logits.float(), inputs["labels"], ignore_index=-100, reduction="sum")


def _fused(inputs: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    return linear_cross_entropy(inputs["hidden"], inputs["weight"], inputs["labels"], chunk_size=chunk)


def _step(loss_fn, inputs: dict[str, torch.Tensor], chunk: int, dtype: torch.dtype) -> float:
    """One loss step under autocast to `dtype` (a no-op in float32); the loss. Gradients are dropped."""
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = loss_fn(inputs, chunk)
    (loss / 1000.0).backward()
    inputs["hidden"].grad = inputs["weight"].grad = None
    return float(loss.detach())


def _peak_bytes(
    loss_fn, inputs: dict[str, torch.Tensor], chunk: int, dtype: torch.dtype
) -> tuple[int, float]:
    """The step's peak of live CPU bytes above its start (allocations and frees in time order), and its loss."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = _step(loss_fn, inputs, chunk, dtype)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="256 tokens, hidden 64, vocab 4,096, chunk 32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.hidden, args.vocab, args.chunk, args.repeats = 256, 64, 4096, 32, 1
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    inputs = _inputs(args.tokens, args.hidden, args.vocab, dtype)
    paths = {"full": _full, "fused": _fused}
    peaks, losses = {}, {}
    for name, loss_fn in paths.items():
        peaks[name], losses[name] = _peak_bytes(loss_fn, inputs, args.chunk, dtype)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, loss_fn in paths.items():
            start = time.perf_counter()
            _step(loss_fn, inputs, args.chunk, dtype)
            times[name].append(time.perf_counter() - start)
    ratios = [b / a for a, b in zip(times["full"][1:], times["fused"][1:], strict=True)]
    logits = args.tokens * args.vocab * 4
    grad_w = args.vocab * args.hidden * 4
    shape = f"{args.tokens} tokens x hidden {args.hidden} x vocab {args.vocab:,}, {args.dtype}"
    print(f"loss step, {shape}; fused chunks of {args.chunk} tokens")
    print(
        f"  [tokens, vocab] float32 logits: {logits:,} bytes; the weight's float32 gradient: {grad_w:,} bytes"
    )
    for name in paths:
        median = statistics.median(times[name][1:])
        print(f"  {name:>5}: peak {peaks[name]:>14,} bytes  (above the weight gradient {peaks[name] - grad_w:>14,})  "
              f"step {median:.3f} s  loss {losses[name]:.6f}")  # fmt: skip
    gap = abs(losses["fused"] - losses["full"]) / abs(losses["full"])
    print(f"  fused / full: peak {peaks['fused'] / peaks['full']:.3f}, above the weight gradient "
          f"{(peaks['fused'] - grad_w) / (peaks['full'] - grad_w):.3f}, step time {statistics.median(ratios):.2f}; "
          f"loss gap {gap:.1e}")  # fmt: skip
    write_rows(
        args.json,
        [
            row("fused / full loss: peak bytes of the loss step", peaks["fused"] / peaks["full"], "small",
                f"{shape}, chunk {args.chunk}: {peaks['full']:,} -> {peaks['fused']:,} bytes (profiler, exact)"),
            row("fused / full loss: peak bytes above the weight gradient",
                (peaks["fused"] - grad_w) / (peaks["full"] - grad_w), "chunk / tokens",
                f"chunk / tokens = {args.chunk / args.tokens:.3f}"),
            row("fused / full loss: step time (CPU)", statistics.median(ratios), "~4/3",
                "one more head matmul (the backward recomputes each chunk)"),
        ],
    )  # fmt: skip


if __name__ == "__main__":
    main()
