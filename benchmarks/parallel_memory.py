"""Per-rank training-state memory and step time of each parallel layout, as ratios of one process.

    OMP_NUM_THREADS=1 uv run python benchmarks/parallel_memory.py

Memory is counted exactly from the tensors a rank holds after one AdamW step: local shards of the
parameters, their gradients and the optimizer state (ideal under FSDP N: 1/N). Step time is the
median of a few steps on the same global batch, compared with a one-process run made just before
each layout (so both see the same load on a shared machine); on a small CPU machine it measures the overhead of
the collectives, not a speed-up (the ranks share the cores). Not part of the test run.
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterable

import torch
import torch._dynamo  # imported once here, not in every forked rank (seconds each)
import torch.distributed._composable.replicate_with_fsdp
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "d9d-parallel", "tests"))

from _common import Row, row, write_rows
from _tiny_transformer import TinyConfig, TinyTransformer, tiny_plan

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    clip_grad_norm_,
    cross_entropy,
    loss_parallel,
    parallelize_hsdp,
    parallelize_tensor_parallel,
)

MODEL = TinyConfig(vocab_size=2048, dim=128, n_heads=4, hidden=512, n_layers=4)
BATCH, SEQ, STEPS, WARMUP = 8, 64, 12, 2

LAYOUTS: dict[str, MeshConfig] = {
    "DDP 2": MeshConfig(data_parallel_replicate=2),
    "FSDP 2": MeshConfig(data_parallel_shard=2),
    "FSDP 4": MeshConfig(data_parallel_shard=4),
    "HSDP 2x2": MeshConfig(data_parallel_replicate=2, data_parallel_shard=2),
    "TP 2": MeshConfig(tensor_parallel=2),
    "FSDP 2 x TP 2": MeshConfig(data_parallel_shard=2, tensor_parallel=2),
}


def _local_bytes(tensors: Iterable[object]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _train(model: nn.Module, ctx: DistributedContext | None, rows: torch.Tensor) -> tuple[int, float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(STEPS):
        start = time.perf_counter()
        with loss_parallel():
            logits = model(rows[:, :-1])
            loss = cross_entropy(logits, rows[:, 1:], reduction="sum") / (BATCH * SEQ)
            loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        if step == 0:
            grads = _local_bytes(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad()
        if ctx is not None:
            ctx.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    params = _local_bytes(model.parameters())
    states = _local_bytes(v for state in opt.state.values() for v in state.values() if v.dim() > 0)
    return params + grads + states, statistics.median(times)


def _single() -> tuple[int, float]:
    torch.manual_seed(0)
    rows = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1))
    return _train(TinyTransformer(MODEL), None, rows)


def _rank(config: MeshConfig) -> tuple[int, float]:
    with DistributedContext.from_env(config) as ctx:
        torch.manual_seed(0)
        rows = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ + 1))
        model = TinyTransformer(MODEL)
        dense = ctx.mesh("dense")
        parallelize_tensor_parallel(model, dense, tiny_plan())
        # One call for every data-parallel layout: DDP, FSDP or HSDP by the mesh (a no-op at dp 1).
        parallelize_hsdp(model, dense, shard_axis="dp_shard", blocks=list(model.blocks))
        dp, dp_rank = ctx.axis_size("dp"), ctx.coordinate("dp")
        per = BATCH // dp
        return _train(model, ctx, rows[dp_rank * per : (dp_rank + 1) * per])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[Row] = []
    base_bytes, base_time = _single()
    n_params = sum(p.numel() for p in TinyTransformer(MODEL).parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters, global batch {BATCH}x{SEQ} tokens, AdamW")
    print(f"one process: {base_bytes / 2**20:.1f} MiB param+grad+optimizer, step {base_time * 1e3:.1f} ms")
    print(
        f"{'layout':<15} {'ranks':>5} {'memory/rank':>12} {'ratio':>7} {'ideal':>7} {'step':>9} "
        f"{'1 proc':>9} {'vs 1 proc':>9}"
    )
    for name, config in LAYOUTS.items():
        base_time = _single()[1]  # re-measured next to each layout: both see the same machine load
        results = run_distributed(_rank, config.world_size, config, timeout=300)
        mem = max(r[0] for r in results)
        step = max(r[1] for r in results)
        sharded_over = config.data_parallel_shard * config.tensor_parallel
        print(
            f"{name:<15} {config.world_size:>5} {mem / 2**20:>9.1f} MiB {mem / base_bytes:>7.3f} "
            f"{1 / sharded_over:>7.3f} {step * 1e3:>6.1f} ms {base_time * 1e3:>6.1f} ms {step / base_time:>8.2f}x"
        )
        rows.append(row(f"{name}: memory/rank / 1 process", mem / base_bytes, f"{1 / sharded_over:.3f}"))
        rows.append(
            row(
                f"{name}: step time / 1 process",
                step / base_time,
                f"{1 / config.world_size:.2f} w/ {config.world_size} free cores",
                f"{config.world_size} ranks share {os.cpu_count()} cores",
            )
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
