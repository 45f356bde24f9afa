"""Trainer step time with every experiment tracker on against metrics.jsonl only.

    OMP_NUM_THREADS=1 uv run python benchmarks/trackers.py [--steps 61] [--rounds 2] [--log-every 10]

Both runs train the quickstart job through `Trainer`; one adds `trainer.tracking.backends:
[tensorboard, wandb, mlflow]` (W&B offline, MLflow's local file store, all under a temporary run
dir). The trackers get records when the metrics file does, every `--log-every` steps, so the time is
taken between the starts of consecutive steps (the step, its records, and every tracker write in
it) and summed over blocks of `--log-every` steps, each holding one flush; blocks after the first
one count. Start-up (importing and starting the trackers, ~4 s) and the final checkpoint are left
out: they happen once per launch. The runs alternate to spread machine noise.

Two ratios: the median block of the tracked runs over that of the jsonl-only runs (A/B, as noisy as
the machine), and, within the tracked runs themselves, their blocks' time over the same time less
what the tracker writes took (`Trackers.log`, timed around each call): not disturbed by load that
changes between runs, but blind to the trackers' background work (W&B's service process,
TensorBoard's writer thread), which the A/B ratio includes.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from _common import row, write_rows  # noqa: E402

from d9d.trainer import Trainer  # noqa: E402
from d9d.trainer.observe.tracking import Trackers  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
BACKENDS = ("tensorboard", "wandb", "mlflow")


def block_times(steps: int, log_every: int, backends: list[str]) -> tuple[list[float], float]:
    """Seconds per block of `log_every` steps (after the first block), each with one records flush,
    and the seconds spent in tracker writes within those blocks."""
    starts: list[float] = []
    writes: list[tuple[int, float]] = []  # (last step of the flush, seconds in Trackers.log)
    log = Trackers.log

    def timed_log(self, records):
        began = time.perf_counter()
        log(self, records)
        if records:
            writes.append((records[-1]["step"], time.perf_counter() - began))

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"trainer.schedule.total_steps={steps}",
            f"trainer.checkpointing.save_dir={tmp}",
            "trainer.checkpointing.period_steps=0",
            f"trainer.logging.period_steps={log_every}",
            "trainer.logging.progress_bar=false",
            "trainer.logging.level=WARNING",
            f"trainer.tracking={{backends: [{', '.join(['jsonl', *backends])}], wandb_mode: offline}}",
        ]
        with Trainer.from_config(CONFIG, overrides) as trainer:
            step = trainer.train_step
            run = step.run

            def timed(*args, **kwargs):
                starts.append(time.perf_counter())
                return run(*args, **kwargs)

            step.run = timed  # type: ignore[method-assign]
            Trackers.log = timed_log  # type: ignore[method-assign]
            try:
                trainer.train()
            finally:
                Trackers.log = log  # type: ignore[method-assign]
    # starts[i] is step i + 1's start: block k spans steps k·n + 1 .. (k+1)·n, to the next block's start
    ends = range(2 * log_every, len(starts), log_every)
    blocks = [starts[end] - starts[end - log_every] for end in ends]
    inside = sum(seconds for last, seconds in writes if log_every < last <= ends[-1])
    return blocks, inside


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=61)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10, help="trainer.logging.period_steps")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    plain: list[float] = []
    tracked: list[float] = []
    writes = 0.0
    for _ in range(args.rounds):  # interleave to spread machine noise over both
        plain += block_times(args.steps, args.log_every, [])[0]
        blocks, inside = block_times(args.steps, args.log_every, args.backends)
        tracked += blocks
        writes += inside
    p, t = statistics.median(plain), statistics.median(tracked)
    direct = sum(tracked) / (sum(tracked) - writes)
    per_step = args.log_every * 1e-3
    print(f"{'records':<26} {'median ms / step':>17} {'blocks':>7}")
    print(f"{'metrics.jsonl only':<26} {p / per_step:>17.2f} {len(plain):>7}")
    print(f"{'+ ' + ', '.join(args.backends):<26} {t / per_step:>17.2f} {len(tracked):>7}")
    print(f"all trackers / jsonl only step time: {t / p:.3f}")
    print(f"tracker writes: {writes / len(tracked) * 1e3:.2f} ms per flush; same-run ratio {direct:.4f}")
    blocks = f"blocks of {args.log_every} steps (one flush each)"
    write_rows(
        args.json,
        [
            row(
                "trackers: all on / jsonl only step time",
                t / p,
                "<= 1.02",
                f"{t / per_step:.0f} vs {p / per_step:.0f} ms per step, median of {len(tracked)} / "
                f"{len(plain)} {blocks}",
            ),
            row(
                "trackers: step time / the same less tracker writes",
                direct,
                "<= 1.02",
                f"{writes / len(tracked) * 1e3:.1f} ms of writes per flush, {blocks}",
            ),
        ],
    )


if __name__ == "__main__":
    main()
