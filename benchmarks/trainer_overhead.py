"""d9d's step time against a hand-written PyTorch loop: same model, data, batch, one process.

    OMP_NUM_THREADS=1 uv run python benchmarks/trainer_overhead.py [--steps 60]

Both loops train the quickstart's reference model on the quickstart corpus with the same global
batch, microbatches, AdamW, gradient clipping and cosine schedule; the plain loop has no
checkpointing, metrics file or logging. Both time the same span (fetching the step's batch, forward,
backward, clipping, the optimizer and LR steps); the median step time after warm-up is compared.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

from _common import row, write_rows  # noqa: E402

from d9d.data import AutoDataConfig, AutoDataProvider, TextDataset  # noqa: E402
from d9d.trainer import Trainer, load_job_config  # noqa: E402
from d9d.trainer.builtins.optim import lr_multiplier  # noqa: E402
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
WARMUP = 5


def plain_loop(steps: int) -> list[float]:
    """The same training as the quickstart, written by hand."""
    job = load_job_config(CONFIG).config
    torch.manual_seed(0)
    model = ReferenceForCausalLM(ReferenceModelConfig(**job.model))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": job.optimizer.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=job.optimizer.lr,
        betas=job.optimizer.betas,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_multiplier(
            s, name="cosine", warmup_steps=job.lr_scheduler.warmup_steps, total_steps=steps, min_lr_ratio=0.0
        ),
    )
    dataset = TextDataset(ROOT / "examples" / "data" / "corpus.txt", job.dataset["seq_len"])
    data = AutoDataProvider(AutoDataConfig(**job.data), dataset)  # the same batches as d9d's
    times = []
    batches = iter(data)
    for _ in range(steps):
        start = time.perf_counter()  # like d9d's step_time_s: fetching the batch is part of the step
        microbatches = next(batches)
        tokens = sum(int(mb["labels"].numel()) for mb in microbatches)
        opt.zero_grad(set_to_none=True)
        for mb in microbatches:
            logits = model(mb["input_ids"])
            loss = (
                F.cross_entropy(logits.flatten(0, 1).float(), mb["labels"].flatten(), reduction="sum")
                / tokens
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.trainer.gradient_clipping.max_norm)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - start)
    return times


def d9d_loop(steps: int) -> list[float]:
    """The quickstart through d9d's Trainer (checkpoint only at the end, logging every 10 steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"trainer.schedule.total_steps={steps}",
            f"trainer.checkpointing.save_dir={tmp}",
            "trainer.checkpointing.period_steps=0",
            "trainer.logging.level=WARNING",
        ]
        with Trainer.from_config(CONFIG, overrides) as trainer:
            trainer.train()
            lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    # the final step includes the checkpoint save: leave it out like the plain loop does
    return [json.loads(line)["step_time_s"] for line in lines][:-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain, d9d = [], []
    for _ in range(args.rounds):  # interleave to spread machine noise over both
        plain += plain_loop(args.steps)[WARMUP:]
        d9d += d9d_loop(args.steps)[WARMUP:]
    p, d = statistics.median(plain), statistics.median(d9d)
    print(f"{'loop':<12} {'median step (ms)':>18} {'steps':>6}")
    print(f"{'plain torch':<12} {p * 1e3:>18.2f} {len(plain):>6}")
    print(f"{'d9d':<12} {d * 1e3:>18.2f} {len(d9d):>6}")
    print(f"d9d / plain step time: {d / p:.3f}")
    note = f"{d * 1e3:.0f} vs {p * 1e3:.0f} ms, median of {len(d9d)} / {len(plain)} steps"
    write_rows(args.json, [row("trainer: d9d / plain loop step time", d / p, "1", note)])


if __name__ == "__main__":
    main()
