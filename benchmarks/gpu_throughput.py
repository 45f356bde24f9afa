"""Training throughput of one GPU: fp32, tf32, bf16, bf16 + compile, bf16 + compile + float8, bf16 +
activation checkpointing, against a hand-written plain PyTorch bf16 loop on the same model and batches.

    uv run python benchmarks/gpu_throughput.py                # one GPU: Llama-3-8B shape cut to 8 layers
    uv run python benchmarks/gpu_throughput.py --tiny         # a tiny model on CPU (a test runs this)

The model is the reference model (`d9d.trainer.models`) with Llama 3 8B's shape (hidden 4096,
MLP 14336, 32 heads, 8 KV heads, vocab 128256, no qk-norm), cut to `--layers` layers (8 ≈ 2.8 B
parameters), seq 8192, microbatch 1. `--layers auto` takes the most layers, up to 8, whose bf16 run
without activation checkpointing fits the free device memory: `d9d plan`'s estimate plus what it
leaves out, the bf16 copies of the weights autocast keeps and the loss's float32 logits and their
gradient, within 95% of what `torch.cuda.mem_get_info` says is free. Each phase runs in its own
process: build time (trainer construction: meta build, parallelize, init), then `--steps` optimizer
steps of `Trainer.train_step` on random tokens, each timed to a device sync; the median after
`--warmup` steps gives tok/s and MFU (the model's own `flops_per_token` against the device's dense
bf16 peak, as the trainer logs it), beside the peak memory and `d9d plan`'s estimate of the phase. The
plain loop builds the same model, runs it under `torch.autocast(bfloat16)` with fused AdamW and
gradient clipping, timed the same way.

`--check NAME` runs the one phase of `--phases` in this process and prints it as the GPU check's
`RESULT NAME ...` line; with `--results DIR` each phase leaves its figures there, so a later phase
says its step time over the plain loop's and its loss beside bf16's (benchmarks/gpu_check_run.py
runs the phases that way, one check each).
"""

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import row, write_rows  # noqa: E402

if TYPE_CHECKING:
    from d9d.trainer.planning import JobPlan

CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"

#: phase → trainer overrides (None: the plain PyTorch loop)
PHASES: dict[str, list[str] | None] = {
    "fp32": ["trainer.precision.param_dtype=float32", "trainer.precision.tf32=false"],
    "tf32": ["trainer.precision.param_dtype=float32", "trainer.precision.tf32=true"],
    "bf16": ["trainer.precision.param_dtype=bfloat16"],
    "bf16+compile": ["trainer.precision.param_dtype=bfloat16", "trainer.compile.enabled=true"],
    "bf16+compile+float8": [
        "trainer.precision.param_dtype=bfloat16",
        "trainer.compile.enabled=true",
        "trainer.precision.float8={recipe: tensorwise}",
    ],
    "bf16+full-ac": ["trainer.precision.param_dtype=bfloat16", "trainer.activation_checkpointing.mode=full"],
    "plain-bf16": None,
}
TINY_PHASES = ["bf16", "bf16+full-ac", "plain-bf16"]  # fp32 is every other test's path
#: The most layers `--layers auto` takes, and the share of the free device memory it plans for.
MAX_LAYERS, FREE_SHARE = 8, 0.95


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


def _result(
    args: argparse.Namespace, times: list[float], build_s: float, device: torch.device, loss: float
) -> dict:
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
        "peak_mem_gib": mem, "build_s": build_s, "loss": loss,
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
                output = trainer.train_step.run(next(data), step)
                _sync(device)
                times.append(time.perf_counter() - start)
    return _result(args, times, build_s, device, float(output.loss))


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
        torch.backends.cuda.matmul.allow_tf32 = True
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
        step_loss = torch.zeros((), device=device)
        for mb in microbatches:
            ids, labels = mb["input_ids"].to(device), mb["labels"].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(ids)
                loss = (
                    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens
                )
            loss.backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return _result(args, times, build_s, device, float(step_loss))


def _child(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    result = run_plain(args) if PHASES[args.child] is None else run_d9d(args, args.child)
    Path(args.out).write_text(json.dumps(result))


def _plan(args: argparse.Namespace, phase: str) -> "JobPlan":
    """`d9d plan`'s plan of a phase (the plain loop: as bf16, the same model and dtypes), with its memory."""
    from d9d.trainer import load_job_config
    from d9d.trainer.planning import plan_config

    sets = PHASES[phase] if PHASES[phase] is not None else PHASES["bf16"]
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_job_config(str(CONFIG), [*_overrides(args, tmp), *(sets or [])])
        return plan_config(loaded, device=args.device)


def _needed_bytes(args: argparse.Namespace) -> int:
    """Device bytes of the bf16 run without activation checkpointing: `d9d plan`'s estimate, plus the
    bf16 copies of the weights autocast keeps from forward to backward and the loss's float32 logits
    and their gradient, which the plan does not count."""
    memory = _plan(args, "bf16").memory
    assert memory is not None
    logits = 2 * 4 * args.seq * _shape(args)["vocab_size"]
    return memory.total + 2 * memory.parameters + logits


def _fitting_layers(args: argparse.Namespace) -> tuple[int, str]:
    """The most layers, up to MAX_LAYERS, whose bf16 run fits FREE_SHARE of the free device memory."""
    free = torch.cuda.mem_get_info()[0]
    for layers in range(MAX_LAYERS, 0, -1):
        need = _needed_bytes(argparse.Namespace(**{**vars(args), "layers": layers}))
        if need <= FREE_SHARE * free:
            return layers, f"{need / 2**30:.1f} of {free / 2**30:.1f} GiB free"
    raise SystemExit(f"not even 1 layer fits: {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")


def _check(args: argparse.Namespace, name: str, results: Path | None) -> None:
    """Run the one phase of `args.phases` here and print it as the GPU check's `RESULT name` line."""
    (phase,) = args.phases
    if "float8" in phase and importlib.util.find_spec("torchao") is None:
        print(f"RESULT {name} SKIP torchao is not installed (bash benchmarks/prepare_gpu_check.sh fetches "
              "its wheel into benchmarks/.wheels, which the GPU check installs)", flush=True)  # fmt: skip
        return
    fits = ""
    if args.layers == "auto":
        args.layers, fits = _fitting_layers(args) if args.device == "cuda" else (MAX_LAYERS, "")
    plan = _plan(args, phase).memory
    torch.manual_seed(0)
    r = run_plain(args) if PHASES[phase] is None else run_d9d(args, phase)
    r["plan_gib"] = plan.total / 2**30 if plan is not None else None
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        (results / f"{phase}.json").write_text(json.dumps(r))
    print(f"RESULT {name} {'PASS' if math.isfinite(r['loss']) else 'FAIL'} {_figures(args, r, results, fits)}",
          flush=True)  # fmt: skip


def _figures(args: argparse.Namespace, r: dict, results: Path | None, fits: str) -> str:
    """A phase's figures, beside the plain loop's and bf16's where `results` holds them."""
    earlier = {path.stem: json.loads(path.read_text()) for path in results.glob("*.json")} if results else {}
    shape = "tiny model" if args.tiny else f"{args.layers} layers" + (f" ({fits})" if fits else "")
    mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
    peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
    text = f"{shape}, seq {args.seq}: {r['tok_s']:.0f} tok/s MFU {mfu} step {r['step_ms']:.1f} ms peak_mem_gib {peak}"
    if r["plan_gib"] is not None:
        text += f" plan_gib {r['plan_gib']:.3g}"
        if r["peak_mem_gib"] is not None:
            text += f" (peak/plan {r['peak_mem_gib'] / r['plan_gib']:.2f})"
    if "plain-bf16" in earlier:
        text += f" d9d/plain {r['step_ms'] / earlier['plain-bf16']['step_ms']:.3f}"
    text += f" loss {r['loss']:.4f}"
    if "bf16" in earlier:
        text += f" (bf16 {earlier['bf16']['loss']:.4f})"
    return text + f" build {r['build_s']:.1f} s"


def _versions() -> str:
    cuda = torch.version.cuda or "none"
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"device {name}, torch {torch.__version__}, CUDA {cuda}"


def _run_phases(args: argparse.Namespace, phases: list[str]) -> dict[str, dict]:
    """Each phase in a process of its own (`--child`), its figures printed as a table row."""
    results: dict[str, dict] = {}
    passthrough = ["--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--device", args.device]  # fmt: skip
    if args.tiny:
        passthrough.append("--tiny")
    with tempfile.TemporaryDirectory() as tmp:
        for phase in phases:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--child", phase, "--out", str(out), *passthrough]
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ)
                )
            except subprocess.TimeoutExpired:
                print(f"{phase}: timed out after {args.timeout} s", flush=True)
                continue
            if done.returncode != 0:
                print(f"{phase}: FAILED\n{done.stderr[-3000:]}", flush=True)
                continue
            results[phase] = r = json.loads(out.read_text())
            mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
            mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
            print(f"{phase:<14} {r['tok_s']:>10.0f} tok/s  MFU {mfu:>6}  step {r['step_ms']:>8.1f} ms  "
                  f"peak {mem:>6} GiB  build {r['build_s']:>6.2f} s", flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, a few steps (for tests)")
    parser.add_argument(
        "--layers", default="auto", help=f"layers, or auto: the most (<= {MAX_LAYERS}) that fit"
    )
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
    parser.add_argument("--check", metavar="NAME", help="run the one phase of --phases here: RESULT NAME ...")
    parser.add_argument("--results", type=Path, help="with --check: the folder the phases share")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (32 if args.tiny else 8192)
    args.steps = args.steps or (4 if args.tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 4)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.layers != "auto":
        args.layers = int(args.layers)
    phases = args.phases or (TINY_PHASES if args.tiny else list(PHASES))
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {list(PHASES)}")
    if args.check:
        if len(phases) != 1:
            parser.error(f"--check runs one phase: name it with --phases (got {phases})")
        try:
            _check(args, args.check, args.results)
        except Exception as error:  # one line for the summary; the traceback stays in the check's log
            traceback.print_exc()
            print(
                f"RESULT {args.check} FAIL {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            )
            sys.exit(1)
        return
    if args.layers == "auto":
        args.layers = _fitting_layers(args)[0] if args.device == "cuda" else MAX_LAYERS
    if args.child:
        _child(args)
        return
    print(f"# gpu_throughput: {_versions()}; {'tiny model' if args.tiny else f'Llama-3-8B shape, {args.layers} layers'}, "
          f"seq {args.seq}, global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up)", flush=True)  # fmt: skip
    results = _run_phases(args, phases)
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
