"""Activation checkpointing per op (`trainer.activation_checkpointing.mode: op`) against none and full.

    OMP_NUM_THREADS=1 uv run python benchmarks/activation_checkpointing.py [--repeats 10] [--tiny]

For the reference model's decoder block (`d9d.trainer.models.DecoderLayer`), per mode:

- On the CPU in float32 (default: hidden 256, SwiGLU 768, 4 query / 2 kv heads, seq 256,
  microbatch 4): the bytes one block keeps for backward (`d9d.parallel.saved_activation_bytes`), and
  the ops its backward runs (a dispatch mode counting them: matmuls, attention kernels, and the cheap
  ops a recompute repeats); then the step time (forward + backward) of a model of `--layers` such
  blocks, the median of `--repeats` steps with the modes alternating, as a ratio to none.
- At Llama-3-8B's shape (hidden 4096, SwiGLU 14336, 32 / 8 heads, seq 8192, microbatch 1) in
  bfloat16 on the meta device (no memory): the bytes one block keeps, and the matmul and attention
  FLOPs of its forward and backward (`torch.utils.flop_counter`): what a mode adds to none's
  backward is its recompute, given as a share of none's forward + backward FLOPs. Attention runs as
  CPU's fused kernel there (the meta device would take SDPA's math path, a seq × seq matrix).

Exact counts, not timings, carry the claim: the CPU step time is shared-machine noise (±15%) and
prices the dispatch mode that per-op checkpointing runs in eager mode (Python per op), which a GPU
step hides and `trainer.compile` removes.
"""

import argparse
import collections
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]

from _common import MB, row, write_rows  # noqa: E402

from d9d.parallel import ActivationCheckpointingConfig, apply_activation_checkpointing, saved_activation_bytes  # noqa: E402
from d9d.trainer.models import DecoderLayer, ReferenceModelConfig, RotaryEmbedding  # noqa: E402

MODES = ("none", "full", "op")
#: The ops whose count in backward shows what a mode recomputes.
WATCHED = ("mm", "_scaled_dot_product_flash_attention_for_cpu", "silu", "rsqrt", "mul")


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """SDPA as CPU's fused kernel (its meta kernel gives the shapes), not the math path meta takes.

    The function itself is replaced while the block runs, forward and backward: a mode would be off
    in the recompute, which runs inside `backward`.
    """

    def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0]

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _config(hidden: int, ffn: int, heads: int, kv_heads: int) -> ReferenceModelConfig:
    return ReferenceModelConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
    )  # fmt: skip


def _block(
    config: ReferenceModelConfig, mode: str, device: str, dtype: torch.dtype, batch: int, seq: int
) -> Any:
    """A checkpointed block, its input and its position embeddings."""
    torch.manual_seed(0)
    with torch.device(device):
        block = DecoderLayer(config, 0).to(dtype)
        rope = RotaryEmbedding(config.attention_head_dim, config.rope_theta, config.rope_scaling)
    apply_activation_checkpointing([block], ActivationCheckpointingConfig(mode=mode))  # type: ignore[arg-type]
    x = torch.randn(batch, seq, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions = rope(torch.arange(seq, device=device)[None], dtype)
    return block, x, positions


def _saved(block: Any, x: torch.Tensor, positions: Any) -> int:
    return saved_activation_bytes(lambda: block(x, position_embeddings=positions), exclude=block.parameters())


def _backward_ops(block: Any, x: torch.Tensor, positions: Any) -> collections.Counter[str]:
    out = block(x, position_embeddings=positions)
    with _OpCounter() as counter:
        out.sum().backward()
    return counter.counts


def _flops(block: Any, x: torch.Tensor, positions: Any) -> tuple[int, int]:
    """Matmul and attention FLOPs of the forward and of the backward (its recompute included)."""
    with FlopCounterMode(display=False) as forward:
        out = block(x, position_embeddings=positions)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    return forward.get_total_flops(), backward.get_total_flops()


def _step_times(
    config: ReferenceModelConfig, layers: int, batch: int, seq: int, repeats: int
) -> dict[str, float]:
    """Median forward + backward time of `layers` blocks per mode, the modes alternating."""
    models = {}
    for mode in MODES:
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList(DecoderLayer(config, i) for i in range(layers))
        apply_activation_checkpointing(blocks, ActivationCheckpointingConfig(mode=mode))  # type: ignore[arg-type]
        models[mode] = blocks
    rope = RotaryEmbedding(config.attention_head_dim, config.rope_theta, config.rope_scaling)
    positions = rope(torch.arange(seq)[None], torch.float32)
    x = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats + 1):  # the first round warms up
        for mode in MODES:
            start = time.perf_counter()
            h = x
            for block in models[mode]:
                h = block(h, position_embeddings=positions)
            h.sum().backward()
            if repeat:
                times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(values) for mode, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a small CPU shape and 2 repeats (a smoke test)")
    parser.add_argument("--json", help="write the ratios here (run_all.py)")
    args = parser.parse_args()
    if args.tiny:
        args.hidden, args.ffn, args.seq, args.batch, args.layers, args.repeats = 64, 128, 32, 2, 2, 2
    rows = []

    cpu = _config(args.hidden, args.ffn, args.heads, args.kv_heads)
    shape = (
        f"hidden {args.hidden}, ffn {args.ffn}, {args.heads}/{args.kv_heads} heads, {args.batch} × {args.seq}"
    )
    print(f"one block on the CPU, float32 ({shape})")
    print(f"{'mode':<6}{'saved bytes':>14}{'/ none':>8}  backward ops " + " ".join(WATCHED))
    saved: dict[str, int] = {}
    for mode in MODES:
        saved[mode] = _saved(*_block(cpu, mode, "cpu", torch.float32, args.batch, args.seq))
        ops = _backward_ops(*_block(cpu, mode, "cpu", torch.float32, args.batch, args.seq))
        counts = " ".join(str(ops[name]) for name in WATCHED)
        print(f"{mode:<6}{saved[mode]:>14,}{saved[mode] / saved['none']:>8.3f}  {counts}")
        if mode != "none":
            rows.append(row(f"AC {mode}: saved bytes per block / none (CPU fp32)", saved[mode] / saved["none"],
                            "op: inputs + matmul and attention outputs"))  # fmt: skip
    times = _step_times(cpu, args.layers, args.batch, args.seq, args.repeats)
    print(f"step time ({args.layers} blocks, median of {args.repeats}): "
          + ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in times.items()))  # fmt: skip
    for mode in ("full", "op"):
        rows.append(row(f"AC {mode}: CPU step time / none", times[mode] / times["none"], "~1 + recompute",
                        f"{args.layers} blocks, eager"))  # fmt: skip

    big = _config(4096, 14336, 32, 8)
    seq = 1024 if args.tiny else 8192
    print(f"\none block at Llama-3-8B's shape on the meta device, bfloat16 (1 × {seq})")
    print(
        f"{'mode':<6}{'saved MiB':>11}{'/ none':>8}{'forward TFLOP':>15}{'backward TFLOP':>16}{'recompute':>11}"
    )
    flops: dict[str, tuple[int, int]] = {}
    with _fused_attention_on_meta():
        for mode in MODES:
            meta_saved = _saved(*_block(big, mode, "meta", torch.bfloat16, 1, seq))
            flops[mode] = _flops(*_block(big, mode, "meta", torch.bfloat16, 1, seq))
            if mode == "none":
                none_saved = meta_saved
            recompute = (flops[mode][1] - flops["none"][1]) / sum(flops["none"])
            print(f"{mode:<6}{meta_saved / MB:>11.1f}{meta_saved / none_saved:>8.3f}{flops[mode][0] / 1e12:>15.3f}"
                  f"{flops[mode][1] / 1e12:>16.3f}{recompute:>10.1%}")  # fmt: skip
            if mode != "none":
                rows.append(row(f"AC {mode}: saved bytes per block / none (8B shape, bf16)",
                                meta_saved / none_saved, "smaller is less memory"))  # fmt: skip
                rows.append(row(f"AC {mode}: recompute FLOPs / none's step (8B shape)", recompute,
                                "op: 0 (no matmul, no attention again)"))  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
