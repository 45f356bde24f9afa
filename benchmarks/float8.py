"""Float8 linears (`trainer.precision.float8`) on the quickstart: the loss against bf16, the float8
matmuls each step runs, and the step time, all through `d9d.trainer.Trainer` on one CPU process.

    OMP_NUM_THREADS=1 uv run python benchmarks/float8.py [--steps 50] [--layers 2 --hidden 128] [--fsdp] [--json rows.json]

The quickstart job (its reference model cut to `--layers` layers of hidden `--hidden`, SwiGLU 3x,
byte vocabulary, seq 128, global batch 16 in microbatches of 2) trains `--steps` steps three times
from the same initialization and data: `param_dtype: bfloat16` (the baseline: what a GPU run
computes in), and bf16 with float8 `tensorwise` and `rowwise`. Printed: the loss of the last step
and the largest per-step relative loss gap to bf16; `aten::_scaled_mm` calls per step (profiler,
one extra run of 2 steps per recipe) against 3 per converted linear and microbatch; the median
step time against bf16. On a CPU the float8 matmul is not faster than bf16 (no float8 units): the
time row says what float8 costs here, not what it gains on an H100 (the GPU check measures that).

With `--fsdp` also FSDP 2 (forked gloo ranks, `tensorwise`, weights all-gathered in float8, 2 steps): the
all-reduces of one weight's absolute maximum per step and rank (torchao's dynamic scale at each
all-gather) and the scale computations over all weights at once, with d9d's per-step precompute
(`d9d.parallel.precompute_float8_scales`) and without it (the path before), and whether the losses
agree (`tests/_quickstart.py`, `train_counting_float8_scales`).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from _common import row, write_rows  # noqa: E402

from d9d.parallel import float8_linears  # noqa: E402
from d9d.trainer import Trainer  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"


def _sets(args: argparse.Namespace, save_dir: str, steps: int, recipe: str | None) -> list[str]:
    sets = [
        f"model.hidden_size={args.hidden}",
        f"model.intermediate_size={3 * args.hidden}",
        f"model.num_layers={args.layers}",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "data.microbatch_size=2",
        "trainer.precision.param_dtype=bfloat16",
        f"trainer.schedule.total_steps={steps}",
        "trainer.checkpointing.period_steps=0",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.logging.progress_bar=false",
        f"trainer.device={args.device}",
    ]
    if recipe is not None:
        sets.append(f"trainer.precision.float8={{recipe: {recipe}}}")
    return sets


def _train(args: argparse.Namespace, steps: int, recipe: str | None) -> tuple[list[float], list[float], int]:
    """Losses, step times (s) and converted linears of one run."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(CONFIG, _sets(args, tmp, steps, recipe)) as t,
    ):
        result = t.train()
        records = [line for line in (Path(t.run_dir) / "metrics.jsonl").read_text().splitlines() if line]
        times = [json.loads(line)["step_time_s"] for line in records]
        return result.losses, times, len(float8_linears(t.model))


def _scaled_mms_per_step(args: argparse.Namespace, recipe: str) -> float:
    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(CONFIG, _sets(args, tmp, 2, recipe)) as t,
        profile() as prof,
    ):
        t.train()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm") / 2


def _fsdp_scale_reductions(args: argparse.Namespace) -> list:
    """FSDP 2, tensorwise: per-weight amax all-reduces and all-weight scale computations per step and
    rank, without d9d's precompute and with it; a row for each, and whether the losses agree."""
    from _quickstart import train_counting_float8_scales

    from d9d.mesh.testing import run_distributed

    steps = 2
    sets = [
        s
        for s in _sets(args, "unused", steps, "tensorwise")
        if not s.startswith("trainer.checkpointing.save_dir=")
    ]
    sets.append("mesh.data_parallel_shard=2")
    runs = {}
    for precompute in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            runs[precompute] = run_distributed(
                train_counting_float8_scales, 2, tmp, sets, precompute, timeout=900
            )
    before, now = runs[False][0], runs[True][0]
    same = all(a["losses"] == b["losses"] for a, b in zip(runs[False], runs[True], strict=True))
    print(
        f"FSDP 2 tensorwise ({now['gathered']} weights gathered in float8): per-weight amax all-reduces a step "
        f"{before['per_weight'] / steps:.0f} before, {now['per_weight'] / steps:.0f} now; all-weight scale "
        f"computations {len(before['all_weights'])} before, {len(now['all_weights'])} in {steps} steps now; "
        f"losses {'identical' if same else 'differ'}"
    )
    return [
        row(
            "float8 FSDP 2: per-weight amax all-reduces a step, now / before",
            now["per_weight"] / before["per_weight"],
            "0",
            f"before {before['per_weight'] / steps:.0f} a step and rank",
        ),
        row(
            "float8 FSDP 2: scale computations over all weights per step (now)",
            len(now["all_weights"]) / (steps + 1),
            "1",
            f"{steps + 1} in {steps} steps: before the first and after each; losses {'identical' if same else 'differ'}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--fsdp", action="store_true", help="also count FSDP 2's float8 scale reductions (CPU ranks)"
    )
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    base_losses, base_times, _ = _train(args, args.steps, None)
    microbatches = 16 // 2
    rows = []
    print(
        f"bf16: final loss {base_losses[-1]:.4f}, median step {statistics.median(base_times[2:]) * 1e3:.0f} ms"
    )
    for recipe in ("tensorwise", "rowwise"):
        losses, times, converted = _train(args, args.steps, recipe)
        gap_final = abs(losses[-1] - base_losses[-1]) / base_losses[-1]
        gap_max = max(abs(a - b) / b for a, b in zip(losses, base_losses, strict=True))
        calls = _scaled_mms_per_step(args, recipe)
        time_ratio = statistics.median(times[2:]) / statistics.median(base_times[2:])
        print(
            f"{recipe}: final loss {losses[-1]:.4f} (gap {gap_final:.2e}, largest per-step gap {gap_max:.2e}); "
            f"{converted} linears, _scaled_mm {calls:.0f} a step (3 x {converted} x {microbatches} microbatches = "
            f"{3 * converted * microbatches}); step time {time_ratio:.2f}x bf16"
        )
        rows += [
            row(
                f"float8 {recipe}: final loss / bf16 after {args.steps} steps",
                losses[-1] / base_losses[-1],
                "~1",
                f"largest per-step gap {gap_max:.1e}",
            ),
            row(
                f"float8 {recipe}: _scaled_mm a step / (3 x linears x microbatches)",
                calls / (3 * converted * microbatches),
                "1",
                f"{converted} linears",
            ),
            row(f"float8 {recipe}: step time / bf16 (CPU: no float8 units)", time_ratio, "> 1 on CPU", ""),
        ]
    if args.fsdp:
        rows += _fsdp_scale_reductions(args)
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
