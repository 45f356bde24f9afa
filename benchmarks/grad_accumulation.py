"""Gradient memory per rank during gradient accumulation: d9d's `set_gradient_accumulation` against
turning gradient sync off until the last microbatch (the old way), for FSDP 2/4, HSDP 2×2 and DDP 2
with 1, 2, 4 and 8 microbatches.

    OMP_NUM_THREADS=1 uv run python benchmarks/grad_accumulation.py

Bytes are counted exactly, each storage once, by where FSDP2 keeps gradients: the sharded `.grad`,
the unsharded gradients on FSDP2's unsharded parameters, and HSDP's reduce-scattered sum waiting for
its all-reduce; the peak is taken after every op inside backward (a dispatch mode). Ideal with N-way
sharding: 1/N of the model's gradients between microbatches, plus one unit's full gradient inside
backward. Forked gloo ranks on CPU; the counts do not depend on the machine.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "d9d-parallel", "tests"))

from _common import row, write_rows
from _grad_memory import Backward, GradMemory
from _tiny_transformer import TinyConfig, make_batches, make_model

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_hsdp, set_gradient_accumulation, set_gradient_sync

CFG = TinyConfig(vocab_size=512, dim=64, n_heads=4, hidden=256, n_layers=8)
BATCH, SEQ = 32, 16
LAYOUTS = {
    "FSDP 2": {"data_parallel_shard": 2},
    "FSDP 4": {"data_parallel_shard": 4},
    "HSDP 2x2": {"data_parallel_replicate": 2, "data_parallel_shard": 2},
    "DDP 2": {"data_parallel_replicate": 2},
}


def _rank(mesh: dict[str, int], microbatches: int) -> dict[str, int]:
    """Peak gradient bytes (between microbatches and inside backward) of each way, on this rank."""
    out = {}
    with DistributedContext.from_env(MeshConfig(**mesh)) as ctx:
        tokens = make_batches(1, BATCH, SEQ)[0]
        per_rank = BATCH // ctx.axis_size("dp")
        rows = tokens[ctx.coordinate("dp") * per_rank : (ctx.coordinate("dp") + 1) * per_rank]
        for mode in ("d9d", "sync_off"):
            model = make_model(cfg=CFG)
            parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
            memory = GradMemory(model)
            between, inside = 0, 0
            for i, micro in enumerate(rows.chunk(microbatches)):
                final = i == microbatches - 1
                if mode == "d9d":
                    set_gradient_accumulation(model, final=final)
                else:
                    set_gradient_sync(model, final)
                logits = model(micro[:, :-1])
                loss = (
                    F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten(), reduction="sum")
                    / tokens.numel()
                )
                recorder = Backward(memory)
                with recorder:
                    loss.backward()
                inside = max(inside, recorder.peak)
                if not final:
                    between = max(between, sum(memory().values()))
            out[f"{mode}_between"], out[f"{mode}_inside"] = between, inside
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--microbatches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    model = make_model(cfg=CFG)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"# model gradients {full / 2**20:.2f} MiB ({CFG.n_layers} blocks); bytes per rank as a fraction of them"
    )
    print(f"{'layout':<10} {'mb':>3} {'d9d between':>12} {'old between':>12} {'d9d peak':>9} {'old peak':>9}")
    rows = []
    for name, mesh in LAYOUTS.items():
        world = 1
        for size in mesh.values():
            world *= size
        for n in args.microbatches:
            if BATCH // (world // mesh.get("tensor_parallel", 1)) < n:
                continue
            worst = {k: max(r[k] for r in run_distributed(_rank, world, mesh, n, timeout=300)) for k in
                     ("d9d_between", "sync_off_between", "d9d_inside", "sync_off_inside")}  # fmt: skip
            f = {k: v / full for k, v in worst.items()}
            print(f"{name:<10} {n:>3} {f['d9d_between']:>12.3f} {f['sync_off_between']:>12.3f} "
                  f"{f['d9d_inside']:>9.3f} {f['sync_off_inside']:>9.3f}", flush=True)  # fmt: skip
            if n == 4:
                rows.append(row(f"grad accumulation peak, {name}, 4 microbatches: d9d / sync off", worst["d9d_inside"] / worst["sync_off_inside"], "1/N + one unit", f"of the model: {f['d9d_inside']:.2f} vs {f['sync_off_inside']:.2f}"))  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
