"""How long a checkpoint save blocks the training loop: sync save vs async save, fresh vs reused staging.

    OMP_NUM_THREADS=1 uv run python benchmarks/async_ckpt.py [--steps 16] [--every 4] [--layers 4]
        [--device cpu|cuda]

The same training loop (reference model, AdamW, one process, torch on 1 thread) runs four times,
each in a fresh subprocess: without checkpoints, with synchronous saves, and with asynchronous saves
of model + optimizer every `--every` steps, once with `reuse_staging=False` (a fresh pageable host
copy per save: DCP's default, d9d's behaviour before staging was reused) and once with the default
`reuse_staging=True` (one set of host buffers, refilled by every save; pinned, with non-blocking
copies, when the model is on CUDA). Before each save the loop calls `manager.wait()` (timed apart:
"wait" is the time the previous async save still needed); "stall" is the wall time of the
`manager.save(...)` call itself, i.e. the copy to host memory and starting the write. The first
save of a reused-staging run allocates its buffers, so stalls are reported for the first save and
as the median over the later ones. The final `close()` waits for the last async save: reported
separately. "Loop" is the total wall time of the loop including every save and the final wait
(on 2 cores the writer thread competes with training). With `--rounds` the runs repeat in
alternating order; stalls are medians over all saves, loop and final-wait times medians over
rounds. CPU timings are noisy (±15%); the loop totals more so than the stalls. On CPU nothing is
pinned (pinning needs CUDA): run with `--device cuda` on a GPU for the pinned figure.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MB, Row, row, write_rows

ROOT = Path(__file__).resolve().parents[1]

MODES = ("none", "sync", "async_fresh", "async")


def _child(mode: str, args: argparse.Namespace) -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    from d9d.ckpt import CheckpointManager
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = ReferenceModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=3 * args.dim,
        num_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    model = ReferenceForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)
    ).to(device)

    def synchronize() -> None:  # a CUDA step's kernels must not be billed to the save after it
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step()  # warm-up, and the optimizer state exists before the first save
    synchronize()
    stalls: list[float] = []
    waits: list[float] = []
    steps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(
            tmp,
            "bench",
            num_to_keep=2,
            async_save=mode.startswith("async"),
            reuse_staging=mode != "async_fresh",
        )
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            train_step()
            synchronize()
            steps.append(time.perf_counter() - t0)
            if mode != "none" and step % args.every == 0:
                t0 = time.perf_counter()
                manager.wait()
                t1 = time.perf_counter()
                manager.save(step, model, opt)
                synchronize()
                stalls.append(time.perf_counter() - t1)
                waits.append(t1 - t0)
        pinned = manager.staging_pinned
        t0 = time.perf_counter()
        manager.close()
        final_wait = time.perf_counter() - t0
        loop = time.perf_counter() - start
        committed = [c.step for c in manager.checkpoints()]
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # params + AdamW moments
    return {
        "mode": mode,
        "stalls": stalls,
        "waits": waits,
        "pinned": pinned,
        "steps": steps,
        "final_wait": final_wait,
        "loop": loop,
        "committed": committed,
        "state_mb": state / MB,
    }


def _run(mode: str, args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    command = [sys.executable, __file__, "--child", mode]
    for key in ("steps", "every", "layers", "dim", "vocab", "batch", "seq", "device"):
        command += [f"--{key}", str(getattr(args, key))]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=4, help="save every N steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each mode; medians reported")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the pinned-staging figure")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args)))
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}  # type: ignore[type-arg]
    for i in range(args.rounds):  # interleaved, alternating order, so all modes see the same load
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            runs[mode].append(_run(mode, args))
    res = {
        mode: {
            "first": [r["stalls"][0] for r in rs if r["stalls"]],
            "later": [s for r in rs for s in r["stalls"][1:]],
            "waits": [w for r in rs for w in r["waits"]],
            "steps": [s for r in rs for s in r["steps"]],
            "final_wait": statistics.median(r["final_wait"] for r in rs),
            "loop": statistics.median(r["loop"] for r in rs),
            "committed": rs[-1]["committed"],
            "pinned": rs[-1]["pinned"],
            "state_mb": rs[-1]["state_mb"],
        }
        for mode, rs in runs.items()
    }
    n_saves = args.steps // args.every
    for mode in MODES[1:]:
        expected = [s for s in range(args.every, args.steps + 1, args.every)][-2:]
        if res[mode]["committed"] != expected:
            raise RuntimeError(f"{mode}: committed {res[mode]['committed']}, expected {expected}")
    pinned = res["async"]["pinned"]
    print(
        f"model + AdamW state {res['sync']['state_mb']:.0f} MB on {args.device}; {args.steps} steps, a "
        f"save every {args.every} ({n_saves} saves); median train step without saves "
        f"{statistics.median(res['none']['steps']) * 1e3:.0f} ms; median of {args.rounds} round(s); "
        f"reused staging {'pinned' if pinned else 'not pinned (no CUDA state)'}"
    )

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1e3 if values else 0.0

    print(
        f"{'mode':<12} {'1st stall ms':>12} {'stall ms':>9} {'wait ms':>8} {'final wait ms':>14} "
        f"{'median step ms':>15} {'loop s':>8}"
    )
    for mode in MODES:
        r = res[mode]
        print(
            f"{mode:<12} {ms(r['first']):>12.0f} {ms(r['later']):>9.0f} {ms(r['waits']):>8.0f} "
            f"{r['final_wait'] * 1e3:>14.0f} {ms(r['steps']):>15.0f} {r['loop']:>8.2f}"
        )
    sync_stall = statistics.median(res["sync"]["first"] + res["sync"]["later"])
    fresh_stall = statistics.median(res["async_fresh"]["first"] + res["async_fresh"]["later"])
    reused_stall = statistics.median(res["async"]["later"])
    reused_first = statistics.median(res["async"]["first"])
    staging = "pinned" if pinned else "reused, unpinned (CPU)"
    base = res["none"]["loop"]
    rows: list[Row] = [
        row(
            "async / sync save stall (per save)",
            reused_stall / sync_stall,
            "-> 0 (only the host copy)",
            f"{reused_stall * 1e3:.0f} vs {sync_stall * 1e3:.0f} ms; staging {staging}, saves 2+",
        ),
        row(
            "async fresh-copy / sync save stall",
            fresh_stall / sync_stall,
            "(the old async path)",
            f"{fresh_stall * 1e3:.0f} ms",
        ),
        row(
            "async reused-staging / fresh-copy stall",
            reused_stall / fresh_stall,
            "< 1 (no allocation; pinned on CUDA)",
            f"first save (allocates) {reused_first * 1e3:.0f} ms",
        ),
        row(
            "loop time with sync saves / no saves",
            res["sync"]["loop"] / base,
            "(baseline)",
            f"{n_saves} saves; {res['sync']['loop']:.1f} vs {base:.1f} s",
        ),
        row(
            "loop time with async saves / no saves",
            res["async"]["loop"] / base,
            "1",
            f"incl. final wait {res['async']['final_wait'] * 1e3:.0f} ms",
        ),
        row(
            "async / sync extra loop time (vs no saves)",
            (res["async"]["loop"] - base) / (res["sync"]["loop"] - base),
            "-> 0",
            "difference of noisy totals",
        ),
    ]
    for r in rows:
        print(f"{r['name']}: {r['ratio']:.2f} (ideal {r['ideal']}) {r['note']}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
