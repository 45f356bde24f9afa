"""Training throughput of one GPU: fp32, tf32, bf16, bf16 + compile, bf16 + activation checkpointing,
against a hand-written plain PyTorch bf16 loop on the same model and batches.

    uv run python benchmarks/gpu_throughput.py                # one GPU: Llama-3-8B shape cut to 8 layers
    uv run python benchmarks/gpu_throughput.py --tiny         # a tiny model on CPU (a test runs this)

The model is the reference model (`d9d.trainer.models`) with Llama 3 8B's shape (hidden 4096,
MLP 14336, 32 heads, 8 KV heads, vocab 128256, no qk-norm), cut to `--layers` layers (8 ≈ 2.8 B
parameters: fits one H200 with AdamW in fp32), seq 8192, microbatch 1. Each phase runs in its own
process: build time (trainer construction: meta build, parallelize, init), then `--steps` optimizer
steps of `Trainer.train_step` on random tokens, each timed to a device sync; the median after
`--warmup` steps gives tok/s and MFU (the model's own `flops_per_token` against the device's dense
bf16 peak, as the trainer logs it). The plain loop builds the same model, runs it under
`torch.autocast(bfloat16)` with fused AdamW and gradient clipping, timed the same way.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import row, write_rows  # noqa: E402

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"

#: phase → trainer overrides (None: the plain PyTorch loop)
PHASES: dict[str, list[str] | None] = {
    "fp32": ["trainer.precision.param_dtype=float32", "trainer.precision.tf32=false"],
    "tf32": ["trainer.precision.param_dtype=float32", "trainer.precision.tf32=true"],
    "bf16": ["trainer.precision.param_dtype=bfloat16"],
    "bf16+compile": ["trainer.precision.param_dtype=bfloat16", "trainer.compile.enabled=true"],
    "bf16+full-ac": ["trainer.precision.param_dtype=bfloat16", "trainer.activation_checkpointing.mode=full"],
    "plain-bf16": None,
}
TINY_PHASES = ["bf16", "bf16+full-ac", "plain-bf16"]  # fp32 is every other test's path


def _shape(args: argparse.Namespace) -> dict:
    if args.tiny:
        return {
            "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "qk_norm": False,
        }  # fmt: skip
    return {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_layers": args.layers,
        "num_attention_heads": 32, "num_key_value_heads": 8, "qk_norm": False, "rope_theta": 500000.0,
        "max_position_embeddings": max(8192, args.seq), "tie_word_embeddings": False,
    }  # fmt: skip


def _overrides(args: argparse.Namespace, save_dir: str) -> list[str]:
    shape = _shape(args)
    dataset = {"samples": 4 * args.steps * args.batch, "seq_len": args.seq, "vocab_size": shape["vocab_size"]}
    return [
        f"model={json.dumps(shape)}",
        f"providers.dataset={HERE / '_synthetic.py'}:SyntheticTokensProvider",
        f"dataset={json.dumps(dataset)}",
        f"data.global_batch_size={args.batch}",
        "data.microbatch_size=1",
        f"trainer.schedule.total_steps={args.steps}",
        f"trainer.checkpointing.save_dir={save_dir}",
        "trainer.checkpointing.period_steps=0",
        "trainer.logging.level=WARNING",
        "lr_scheduler.name=constant",
        f"trainer.device={args.device}",
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _result(args: argparse.Namespace, times: list[float], build_s: float, device: torch.device) -> dict:
    from d9d.trainer.models import ReferenceModelConfig
    from d9d.trainer.observe.throughput import device_peak_flops

    steady = times[args.warmup :] or times
    step_s = statistics.median(steady)
    tokens = args.batch * args.seq
    tok_s = tokens / step_s
    flops = ReferenceModelConfig(**_shape(args)).flops_per_token(args.seq)
    peak = device_peak_flops(device)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        "step_ms": step_s * 1e3, "tok_s": tok_s, "mfu": tok_s * flops / peak if peak else None,
        "peak_mem_gib": mem, "build_s": build_s,
    }  # fmt: skip


def run_d9d(args: argparse.Namespace, phase: str) -> dict:
    from d9d.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        trainer = Trainer.from_config(CONFIG, [*_overrides(args, tmp), *(PHASES[phase] or [])])
        device = trainer.context.device
        _sync(device)
        build_s = time.perf_counter() - start
        with trainer:
            data = iter(trainer.data)
            times = []
            for step in range(1, args.steps + 1):
                start = time.perf_counter()
                trainer.train_step.run(next(data), step)
                _sync(device)
                times.append(time.perf_counter() - start)
    return _result(args, times, build_s, device)


def run_plain(args: argparse.Namespace) -> dict:
    """The same model and batches in a loop a user would write by hand (bf16 autocast, fused AdamW)."""
    import torch.nn.functional as F
    from _synthetic import SyntheticConfig, SyntheticTokens

    from d9d.data import AutoDataConfig, AutoDataProvider
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig

    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    start = time.perf_counter()
    config = ReferenceModelConfig(**_shape(args))
    with torch.device("meta"):
        model = ReferenceForCausalLM(config)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4, **fused
    )
    _sync(device)
    build_s = time.perf_counter() - start
    dataset = SyntheticTokens(
        SyntheticConfig(samples=4 * args.steps * args.batch, seq_len=args.seq, vocab_size=config.vocab_size)
    )
    data = iter(AutoDataProvider(AutoDataConfig(global_batch_size=args.batch, microbatch_size=1), dataset))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        microbatches = next(data)
        opt.zero_grad(set_to_none=True)
        tokens = sum(mb["labels"].numel() for mb in microbatches)
        for mb in microbatches:
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(ids)
                loss = (
                    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens
                )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return _result(args, times, build_s, device)


def _child(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    result = run_plain(args) if PHASES[args.child] is None else run_d9d(args, args.child)
    Path(args.out).write_text(json.dumps(result))


def _versions() -> str:
    cuda = torch.version.cuda or "none"
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"device {name}, torch {torch.__version__}, CUDA {cuda}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, a few steps (for tests)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1, help="global batch (microbatches of 1)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--device", default=None, help="auto | cuda | cpu (default: cpu with --tiny, else cuda)"
    )
    parser.add_argument("--phases", nargs="*", default=None, help=f"a subset of {list(PHASES)}")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per phase")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (32 if args.tiny else 8192)
    args.steps = args.steps or (4 if args.tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 4)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.child:
        _child(args)
        return
    phases = args.phases or (TINY_PHASES if args.tiny else list(PHASES))
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    print(f"# gpu_throughput: {_versions()}; {'tiny model' if args.tiny else f'Llama-3-8B shape, {args.layers} layers'}, "
          f"seq {args.seq}, global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up)", flush=True)  # fmt: skip
    results: dict[str, dict] = {}
    passthrough = ["--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--device", args.device]  # fmt: skip
    if args.tiny:
        passthrough.append("--tiny")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        for phase in phases:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--child", phase, "--out", str(out), *passthrough]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            except subprocess.TimeoutExpired:
                print(f"{phase}: timed out after {args.timeout} s", flush=True)
                continue
            if done.returncode != 0:
                print(f"{phase}: FAILED\n{done.stderr[-3000:]}", flush=True)
                continue
            results[phase] = json.loads(out.read_text())
            r = results[phase]
            mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
            mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
            print(f"{phase:<14} {r['tok_s']:>10.0f} tok/s  MFU {mfu:>6}  step {r['step_ms']:>8.1f} ms  "
                  f"peak {mem:>6} GiB  build {r['build_s']:>6.2f} s", flush=True)  # fmt: skip
    rows = []
    plain = results.get("plain-bf16")
    if plain is not None:
        for phase in ("bf16", "bf16+compile"):
            if phase in results:
                ratio = results[phase]["step_ms"] / plain["step_ms"]
                print(f"d9d {phase} / plain bf16 loop step time: {ratio:.3f}")
                rows.append(row(f"gpu step: d9d {phase} / plain bf16 loop", ratio, "<= 1.03", _versions()))
    write_rows(args.json, rows)
    if len(results) != len(phases):
        sys.exit(1)


if __name__ == "__main__":
    main()
