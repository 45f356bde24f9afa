"""Optimizer states in bfloat16 (`optimizer.state_dtype: bfloat16`) on the quickstart, through
`d9d.trainer.Trainer`: the state bytes each rank holds, the loss drift and the step time against
float32 states.

    OMP_NUM_THREADS=1 uv run python benchmarks/optimizer_states.py [--steps 200] [--tiny] [--json rows.json]

State bytes: every per-parameter tensor in the built optimizer's state (AdamW's `exp_avg` and
`exp_avg_sq`, a DTensor's local shard; `d9d.parallel.optimizer_state_bytes`), counted after the
first step, on one process and on each rank of FSDP 2 (forked ranks, gloo), for float32 and
bfloat16 states; the plan's estimate (`d9d plan`) is printed beside them. Loss drift: the quickstart
job as shipped (200 steps, AdamW, cosine schedule) run twice from the same initialization and data,
float32 and bfloat16 states: the final loss's relative gap and the largest per-step one. Step time:
the median step of each run (from metrics.jsonl) and, apart, `optimizer.step()` alone on the
quickstart model, the two optimizers timed alternately (bfloat16 states add an upcast and a rounding
per state element).
`--tiny` (hidden 64, 2 layers, seq 32, 4 steps) is the smoke test.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # imported once here, not in every forked rank (seconds each)
import torch.distributed.fsdp

ROOT = Path(__file__).resolve().parents[1]

from _common import row, write_rows  # noqa: E402

from d9d.mesh import DistributedContext  # noqa: E402
from d9d.mesh.testing import run_distributed  # noqa: E402
from d9d.parallel import optimizer_state_bytes  # noqa: E402
from d9d.trainer import Trainer, load_job_config, resolve_job  # noqa: E402
from d9d.trainer.planning import plan_job  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "dataset.seq_len=32"]


def _sets(args: argparse.Namespace, save_dir: str, dtype: str, steps: int, *extra: str) -> list[str]:
    return [
        *(TINY if args.tiny else []),
        f"optimizer.state_dtype={dtype}",
        f"trainer.schedule.total_steps={steps}",
        "trainer.checkpointing.period_steps=0",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.logging.progress_bar=false",
        "trainer.logging.period_steps=1",
        "trainer.device=cpu",
        *extra,
    ]


def _state_bytes(sets: list[str]) -> int:
    """This rank's optimizer state bytes after one step."""
    with Trainer.from_config(str(CONFIG), sets) as trainer:
        trainer.train()
        return optimizer_state_bytes(trainer.optimizer)


def _planned(sets: list[str]) -> int:
    """`d9d plan`'s per-rank optimizer estimate."""
    job = resolve_job(load_job_config(str(CONFIG), sets))
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        plan = plan_job(job, ctx, memory=True)
    assert plan.memory is not None
    return plan.memory.state.optimizer


def _run(sets: list[str]) -> tuple[list[float], list[float]]:
    """Losses and step times (s) of one run."""
    with Trainer.from_config(str(CONFIG), sets) as trainer:
        losses = trainer.train().losses
        lines = (Path(trainer.run_dir) / "metrics.jsonl").read_text().splitlines()
    return losses, [json.loads(line)["step_time_s"] for line in lines if line]


def _optimizer_step_ratio(args: argparse.Namespace, repeats: int) -> tuple[float, float]:
    """Median seconds of `optimizer.step()` alone on the quickstart model (random gradients) with
    float32 states, and the median ratio bfloat16 / float32 of steps timed alternately (so the load
    of a shared machine falls on both alike)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainers = [
            Trainer.from_config(str(CONFIG), _sets(args, f"{tmp}/{d}", d, 1)) for d in ("float32", "bfloat16")
        ]
        try:
            generator = torch.Generator().manual_seed(0)
            for trainer in trainers:
                for p in trainer.model.parameters():
                    p.grad = torch.randn(p.shape, generator=generator) * 1e-3
            times: list[list[float]] = [[], []]
            for _ in range(repeats + 2):
                for i, trainer in enumerate(trainers):
                    start = time.perf_counter()
                    trainer.optimizer.step()
                    times[i].append(time.perf_counter() - start)
        finally:
            for trainer in trainers:
                trainer.close()
    ratios = [b / a for a, b in zip(times[0][2:], times[1][2:], strict=True)]
    return statistics.median(times[0][2:]), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=20, help="optimizer.step() timings per dtype")
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, seq 32, 4 steps")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    steps = 4 if args.tiny else args.steps
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # the forked ranks first: fork before this process has run a trainer (threads, process groups)
        sets = {d: (_sets(args, f"{tmp}/one", d, 1), _sets(args, f"{tmp}/fsdp", d, 1, "mesh.data_parallel_shard=2"))
                for d in ("float32", "bfloat16")}  # fmt: skip
        counted: dict[str, Any] = {
            d: {"fsdp": run_distributed(_state_bytes, 2, sets[d][1], timeout=300)} for d in sets
        }
        for dtype, (one, fsdp) in sets.items():
            c = counted[dtype]
            c.update(one=_state_bytes(one), plan_one=_planned(one), plan_fsdp=_planned(fsdp))
            print(f"{dtype} states: one process {c['one']:,} bytes (plan {c['plan_one']:,}); "
                  f"FSDP 2 per rank {c['fsdp'][0]:,} + {c['fsdp'][1]:,} (plan {c['plan_fsdp']:,} each)")  # fmt: skip
        f32, bf16 = counted["float32"], counted["bfloat16"]
        rows.append(row("bf16 / fp32 optimizer state bytes, one process", bf16["one"] / f32["one"], "0.5",
                        f"{f32['one']:,} -> {bf16['one']:,} bytes, counted from the tensors"))  # fmt: skip
        for rank in (0, 1):
            rows.append(row(f"bf16 / fp32 optimizer state bytes, FSDP 2 rank {rank}",
                            bf16["fsdp"][rank] / f32["fsdp"][rank], "0.5",
                            f"{f32['fsdp'][rank]:,} -> {bf16['fsdp'][rank]:,} bytes"))  # fmt: skip
        rows.append(row("bf16 states: d9d plan's optimizer estimate / counted, one process",
                        bf16["plan_one"] / bf16["one"], "1", ""))  # fmt: skip

        losses: dict[str, list[float]] = {}
        times: dict[str, list[float]] = {}
        for dtype in ("float32", "bfloat16"):
            losses[dtype], times[dtype] = _run(_sets(args, f"{tmp}/{dtype}", dtype, steps))
    final = abs(losses["bfloat16"][-1] - losses["float32"][-1]) / losses["float32"][-1]
    gaps = [abs(a - b) / b for a, b in zip(losses["bfloat16"], losses["float32"], strict=True)]
    largest = max(gaps)
    at = 1 + gaps.index(largest)
    step_ratio = statistics.median(times["bfloat16"][1:]) / statistics.median(times["float32"][1:])
    print(f"loss after {steps} steps: float32 states {losses['float32'][-1]:.5f}, bfloat16 "
          f"{losses['bfloat16'][-1]:.5f} (drift {100 * final:.3f}%, largest per-step {100 * largest:.3f}% at step {at})")  # fmt: skip
    float32_s, optimizer_ratio = _optimizer_step_ratio(args, args.repeats)
    print(f"median step time bf16 / fp32 states: {step_ratio:.3f}; optimizer.step() alone: {optimizer_ratio:.2f} "
          f"(fp32 {float32_s * 1e3:.1f} ms)")  # fmt: skip
    rows += [
        row(f"bf16 states: final loss drift after {steps} quickstart steps (%)", 100 * final, "~0",
            f"largest per-step {100 * largest:.3f}% (step {at})"),
        row("bf16 / fp32 states: median step time", step_ratio, "~1", "forward + backward + optimizer"),
        row("bf16 / fp32 states: optimizer.step() alone", optimizer_ratio, "> 1 (upcast + rounding)",
            f"quickstart model, one CPU thread; fp32 {float32_s * 1e3:.1f} ms"),
    ]  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
