"""The attention kernels (`trainer.attention.backend`) on the quickstart: which SDPA kernel each step
runs, the loss against SDPA's own choice, and the step time, through `d9d.trainer.Trainer` on one CPU process.

    OMP_NUM_THREADS=1 uv run python benchmarks/attention_backends.py [--steps 12] [--seq 512] [--json rows.json]

The quickstart (its reference model cut to `--layers` layers of hidden `--hidden`, float32, global
batch 8 in microbatches of 2, seq `--seq`) trains `--steps` steps once per backend that CPU has
(`auto`, `flash`, `math`) and once as before `trainer.attention` existed: SDPA left to pick its kernel
itself (the step's settings without a kernel), from the same initialization and data; the four
trainers are built first and their steps interleaved, so all see the same load. Printed: the SDPA
kernel ops of one more step each (profiler), the largest per-step relative loss gap to SDPA's own
choice, and the median step time (the first step left out) against it.
CPU has only two kernels (its fused `flash` and `math`); cuDNN, efficient and FlexAttention speeds
are GPU figures (`benchmarks/gpu_check.sh`).
"""

import argparse
import collections
import contextlib
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]

from _common import row, write_rows  # noqa: E402

from d9d.trainer import Trainer  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "flash backward",
    "aten::_scaled_dot_product_attention_math": "math",
}
#: "sdpa's own": the step without a kernel (SDPA's own choice, as before trainer.attention).
BACKENDS = ("sdpa's own", "auto", "flash", "math")


def _sets(args: argparse.Namespace, save_dir: str, backend: str) -> list[str]:
    return [
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={3 * args.hidden}",
        f"model.num_layers={args.layers}",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        f"dataset.seq_len={args.seq}",
        "data.global_batch_size=8",
        "data.microbatch_size=2",
        "trainer.precision.param_dtype=float32",
        "trainer.checkpointing.period_steps=0",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.logging.level=WARNING",
        "trainer.logging.progress_bar=false",
        f"trainer.attention.backend={'auto' if backend == BACKENDS[0] else backend}",
    ]


def _measure(args: argparse.Namespace) -> dict[str, tuple[list[float], list[float], dict[str, float]]]:
    """Per backend: losses, step times (s) and kernel ops per step. One trainer per backend, all built
    first, their steps interleaved (backend by backend within each step), so every backend sees the
    same machine load."""
    with contextlib.ExitStack() as stack:
        runs = {}
        for backend in BACKENDS:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            trainer = stack.enter_context(Trainer.from_config(CONFIG, _sets(args, tmp, backend)))
            step = trainer.train_step
            if backend == BACKENDS[0]:
                step.settings = dataclasses.replace(step.settings, attention=None)  # type: ignore[attr-defined]
            runs[backend] = (step, iter(trainer.data), [], [])
        for number in range(1, args.steps + 1):
            for step, batches, losses, times in runs.values():
                batch = next(batches)
                start = time.perf_counter()
                losses.append(float(step.run(batch, number).loss))
                times.append(time.perf_counter() - start)
        ops = {}
        for backend, (step, batches, _, _) in runs.items():  # one more step each, under the profiler
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step.run(next(batches), args.steps + 1)
            counts = collections.Counter(KERNELS[e.name] for e in prof.events() if e.name in KERNELS)
            ops[backend] = dict(counts)
        return {
            backend: (run[2], run[3][1:], ops[backend]) for backend, run in runs.items()
        }  # step 1 warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = _measure(args)
    own_losses, own_times, _ = results[BACKENDS[0]]
    base = statistics.median(own_times)
    print(f"quickstart, {args.layers} layers × hidden {args.hidden}, seq {args.seq}, 4 microbatches of 2, float32, "
          f"{args.steps} steps, interleaved; baseline: SDPA's own choice")  # fmt: skip
    print(f"{'backend':<12}{'kernel ops per step':<52}{'loss gap':>10}{'ms/step':>10}{'vs own':>8}")
    rows = []
    for backend, (losses, times, ops) in results.items():
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, own_losses, strict=True))
        median = statistics.median(times)
        kernels = ", ".join(f"{name} {n:g}" for name, n in sorted(ops.items()))
        print(f"{backend:<12}{kernels:<52}{gap:>10.1e}{median * 1e3:>10.1f}{median / base:>8.2f}")
        if backend != BACKENDS[0]:
            rows.append(row(f"attention {backend}: step / SDPA's own choice", median / base, "1 (flash: the same kernel)",
                            f"loss gap {gap:.1e}; {kernels} per step"))  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
