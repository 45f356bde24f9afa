"""d9d's checks of the CUDA paths CPU tests cannot reach (run by benchmarks/gpu_check.sh, in the order
and under the budget of benchmarks/gpu_check_run.py).

    python benchmarks/gpu_check.py CHECK [ARG]   # CHECK: env | dtypes | cp | flex | syncs | quickstart RUNS
                                                 #   | moe_compile RUNS | fsdp | fsdp_compiled | cpu_offload

Each check prints one `RESULT <check> <PASS|FAIL|INFO> <details>` line. On a GPU the shapes are
the real ones (hidden 2048, seq 4096-8192); with `DEVICE=cpu` (or no GPU) they shrink and the check
runs the same code as a dry run: it catches Python errors and the dtype contract, and proves
nothing about CUDA kernels. Uses the packages' public API, plus two context-parallel helpers and the
trainer's peak-FLOPs table; the FSDP checks are in gpu_check_fsdp.py.
"""

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = [
    str(ROOT / "examples" / "quickstart" / "train.py"),
    str(ROOT / "examples" / "quickstart" / "config.yaml"),
]
#: The quickstart cut down for a dry run on CPU.
TINY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "dataset.seq_len=64"]
MOE = ["model.moe={num_experts: 8, top_k: 2, moe_intermediate_size: 128}"]

DEVICE = torch.device(os.environ.get("DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
CUDA = DEVICE.type == "cuda"


def report(check: str, passed: bool | None, details: str) -> None:
    status = "INFO" if passed is None else ("PASS" if passed else "FAIL")
    print(f"RESULT {check} {status} {details}", flush=True)


def synchronize() -> None:
    if CUDA:
        torch.cuda.synchronize()


def kernel_names(fn: Callable[[], object]) -> list[str]:
    """The CUDA kernels `fn()` launches (profiler); on CPU `fn()` runs and the list is empty."""
    if not CUDA:
        fn()
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize()
    return [event.name for event in prof.events() if event.device_type.name == "CUDA"]


_ATTENTION_KERNELS = {
    "flash": ("flash",),
    "cudnn": ("cudnn", "sdpa_fprop", "fmha_cudnn"),
    "mem_efficient": ("fmha_cutlass", "efficient_attention", "attention_kernel"),
    "flex": ("triton_tem_fused", "flex"),
}


def attention_kind(names: list[str]) -> str:
    text = " ".join(name.lower() for name in names)
    found = [kind for kind, keys in _ATTENTION_KERNELS.items() if any(key in text for key in keys)]
    return "+".join(found) or ("none-seen" if CUDA else "cpu")


def gemm_dtypes(names: list[str]) -> set[str]:
    """fp32/tf32/bf16 as cuBLAS/CUTLASS kernel names show them ("nvjet" kernels carry no dtype)."""
    found = set()
    for name in (n.lower() for n in names):
        if not any(key in name for key in ("gemm", "xmma", "cutlass", "nvjet")):
            continue
        if "bf16" in name:
            found.add("bf16")
        elif "tf32" in name:
            found.add("tf32")
        elif "sgemm" in name or "f32" in name:
            found.add("fp32")
    return found


def reference_model(
    hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, seq: int
) -> torch.nn.Module:
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig

    config = ReferenceModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        qk_norm=True,
        max_position_embeddings=seq,
    )
    with torch.device("meta"):
        return ReferenceForCausalLM(config)


def check_env() -> None:
    from d9d.trainer.observe.throughput import device_peak_flops  # the peak the trainer's MFU divides by

    info: dict[str, object] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(DEVICE),
                               "python": sys.version.split()[0]}  # fmt: skip
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(total / 2**30, 1),
            free_gib=round(free / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
            driver=_driver(),
        )
    info["peak_bf16_tflops"] = (device_peak_flops(DEVICE) or 0) / 1e12
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except ImportError:
        info["torchao"] = None
    report("env", None, json.dumps(info))


def _driver() -> str | None:
    """The driver version nvidia-smi reports (torch does not)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def check_dtypes() -> None:
    """The one-device (autocast) path: the residual stream, q/k/v at attention and the GEMMs are bf16."""
    from d9d.trainer import materialize_and_initialize

    hidden, seq = (2048, 4096) if CUDA else (64, 64)
    model = reference_model(hidden, 2, 16 if CUDA else 4, 4 if CUDA else 2, 32000 if CUDA else 512, seq)
    materialize_and_initialize(model, DEVICE, 0)
    attention_inputs: list[str] = []
    residual: list[str] = []
    sdpa = F.scaled_dot_product_attention

    def spy(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        attention_inputs.append("/".join(str(t.dtype).removeprefix("torch.") for t in (q, k, v)))
        return sdpa(q, k, v, *args, **kwargs)

    layer = model.model.layers["0"]
    layer.register_forward_hook(
        lambda module, args, out: residual.append(str(out.dtype).removeprefix("torch."))
    )
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=DEVICE)

    def step() -> None:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()

    F.scaled_dot_product_attention = spy
    try:
        step()
        names = kernel_names(step)
    finally:
        F.scaled_dot_product_attention = sdpa
    kind, gemms = attention_kind(names), gemm_dtypes(names)
    passed = attention_inputs[0] == "bfloat16/bfloat16/bfloat16" and residual[0] == "bfloat16"
    if CUDA:
        passed = passed and ("flash" in kind or "cudnn" in kind) and not ({"fp32", "tf32"} & gemms)
    report(
        "dtypes",
        passed,
        f"attention q/k/v={attention_inputs[0]} residual={residual[0]} kernel={kind} gemms={sorted(gemms)} "
        "(expected: bf16 everywhere, a flash or cuDNN kernel)",
    )


def _store(
    pieces: list[torch.Tensor | None], index: int, fn: Callable[..., torch.Tensor], args: tuple
) -> None:
    pieces[index] = fn(*args)


def check_cp() -> None:
    """Context-parallel attention on the device: each rank's two lower-right causal chunks, put back
    together, equal full causal attention (forward and the three gradients), GQA and fp32 included."""
    from d9d.parallel.context_parallel import _causal_lower_right, _chunk_ids

    torch.manual_seed(0)
    seq, heads, head_dim = (8192, 32, 128) if CUDA else (256, 4, 16)
    lines, passed = [], True
    for cp, kv_heads, dtype in (
        (2, 8, torch.bfloat16),
        (4, 8, torch.bfloat16),
        (2, 32, torch.bfloat16),
        (2, 8, torch.float32),
    ):
        kv_heads = min(kv_heads, heads)
        gqa = kv_heads != heads
        q = torch.randn(1, heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        grad = torch.randn(1, heads, seq, head_dim, device=DEVICE, dtype=dtype)
        full = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa)
        want = (full, *torch.autograd.grad(full, (q, k, v), grad.float()))
        chunk = seq // (2 * cp)
        pieces: list[torch.Tensor | None] = [None] * (2 * cp)
        names: list[str] = []
        for rank in range(cp):
            for c in _chunk_ids(cp, rank):
                stop = (c + 1) * chunk
                # chunk c attends to every key up to its end, aligned lower-right
                args = (q[:, :, c * chunk : stop], k[:, :, :stop], v[:, :, :stop], None, gqa)
                attend = functools.partial(_store, pieces, c, _causal_lower_right, args)
                if rank == 0 and c != 0:
                    names = kernel_names(attend)
                else:
                    attend()
        out = torch.cat([p for p in pieces if p is not None], 2)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
        errors = [
            ((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True)
        ]
        good = max(errors) < (2e-2 if dtype == torch.bfloat16 else 2e-3)
        passed &= good
        lines.append(
            f"cp{cp}/kv{kv_heads}/{str(dtype).removeprefix('torch.')} rel err out,dq,dk,dv="
            f"{','.join(f'{e:.1e}' for e in errors)} kernel={attention_kind(names)} {'ok' if good else 'BAD'}"
        )
    report("cp_attention", passed, " | ".join(lines))


def check_flex() -> None:
    """Document masks: FlexAttention (its block mask and kernel compiled on CUDA, eager on CPU) equals
    masked SDPA over four batches of different document layouts; forward and the three gradients on
    CUDA, the forward on CPU (torch has no FlexAttention backward there); the compiles counted."""
    from torch._dynamo.utils import counters

    from d9d.parallel import DocumentMask

    torch.manual_seed(0)
    batch, seq, heads, kv_heads, head_dim = (2, 4096, 16, 4, 128) if CUDA else (1, 128, 4, 2, 16)
    dtype = torch.bfloat16 if CUDA else torch.float32
    lines, passed, times = [], True, []
    for layout in range(4):
        cuts = (
            torch.randint(1, seq, (batch, 6), generator=torch.Generator().manual_seed(layout)).sort(-1).values
        )
        documents = (torch.arange(seq)[None, None, :] >= cuts[:, :, None]).sum(1).to(DEVICE)
        q = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=CUDA)
        k = torch.randn(batch, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=CUDA)
        v = torch.randn(batch, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=CUDA)
        grad = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=dtype)
        start = time.perf_counter()
        mask = DocumentMask(documents, backend="flex")
        got = _with_grads(mask.attention(q, k, v), (q, k, v), grad)
        synchronize()
        times.append(time.perf_counter() - start)
        want = _with_grads(DocumentMask(documents, backend="sdpa").attention(q, k, v), (q, k, v), grad)
        errors = [
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(got, want, strict=True)
        ]
        good = max(errors) < (3e-2 if dtype == torch.bfloat16 else 1e-4)
        passed &= good
        if layout in (0, 3):
            lines.append(
                f"layout{layout} {mask.backend} vs sdpa rel err {'out,dq,dk,dv' if CUDA else 'out'}="
                f"{','.join(f'{e:.1e}' for e in errors)} {'ok' if good else 'BAD'}"
            )
    graphs = counters["stats"]["unique_graphs"]
    lines.append(f"unique_graphs={graphs} ms(first,last)={times[0] * 1e3:.0f},{times[-1] * 1e3:.1f}")
    report("flex_docmask", passed, " | ".join(lines))


def _with_grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor) -> tuple:
    """`out` and, when it has a graph, the gradients of `inputs` under `grad`."""
    return (out, *torch.autograd.grad(out, inputs, grad)) if out.requires_grad else (out,)


def metrics_line(path: Path) -> tuple[bool, str]:
    """Whether a run's loss fell and stayed finite, and its figures as the summary shows them: the
    first and last loss, and the last record's throughput and peak memory (every `peak_*` key the
    records write: `peak_mem_gib` on CUDA, `peak_rss_gib` on CPU)."""
    steps = [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]
    first, last = steps[0], steps[-1]
    ok = last["loss"] < first["loss"] and all(math.isfinite(r["loss"]) for r in steps)
    figures = {k: v for k, v in last.items() if k in ("tokens_per_s", "mfu") or k.startswith("peak_")}
    return ok, (
        f"steps {first['step']}..{last['step']} loss {first['loss']:.3f}->{last['loss']:.3f} "
        + " ".join(f"{k}={v:.4g}" for k, v in figures.items())
    )


def _train(args: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """The quickstart's train.py with `args` on this device (tiny on CPU), its output appended to `log`."""
    device = [f"trainer.device={DEVICE.type}", "trainer.logging.progress_bar=false"]
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, *QUICKSTART, *device, *([] if CUDA else TINY), *args],
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)  # fmt: skip
    return done.returncode


def check_quickstart(runs: str) -> None:
    """The quickstart on the device: 20 steps, checkpoints at 10 and 20, one profiled step with a memory
    snapshot (into the check's logs), then a resume to 24 from the device's checkpoint."""
    logs = Path(os.environ.get("D9D_GPU_CHECK_LOGS") or tempfile.mkdtemp())
    log = logs / "quickstart.train.log"
    common = [
        f"trainer.checkpointing.save_dir={runs}",
        "trainer.run.name=qs",
        "trainer.logging.period_steps=5",
    ]
    first = _train([*common, "trainer.schedule.total_steps=20", "trainer.checkpointing.period_steps=10",
                    "trainer.profiling.start_step=6", "trainer.profiling.active_steps=1",
                    "trainer.profiling.memory_snapshot=true", f"trainer.profiling.dir={logs / 'profile'}"], log)  # fmt: skip
    second = _train([*common, "trainer.schedule.total_steps=24"], log) if first == 0 else None
    if first != 0 or second != 0:
        tail = " ".join(log.read_text(errors="replace")[-300:].split())
        report("quickstart", False, f"train.py exited {first}, resume {second}: {tail}")
        return
    metrics = Path(runs) / "qs" / "metrics.jsonl"
    ok, line = metrics_line(metrics)
    resumed = '"step": 24' in metrics.read_text()
    report("quickstart", ok and resumed, f"{line} resumed 20->24 {'yes' if resumed else 'NO'}")


def check_moe_compile(runs: str) -> None:
    """The MoE quickstart compiled, with full activation checkpointing: its loss, and the graph breaks
    and recompiles dynamo logs (TORCH_LOGS=graph_breaks,recompiles, set by the runner)."""
    log = Path(os.environ.get("D9D_GPU_CHECK_LOGS") or tempfile.mkdtemp()) / "moe_compile.train.log"
    code = _train([f"trainer.checkpointing.save_dir={runs}", "trainer.run.name=moe", "trainer.schedule.total_steps=6",
                   "trainer.checkpointing.period_steps=0", "trainer.logging.period_steps=1", *MOE,
                   "trainer.compile.enabled=true", "trainer.activation_checkpointing.mode=full"], log)  # fmt: skip
    text = log.read_text(errors="replace")
    if code != 0:
        report("moe_compile", False, f"train.py exited {code}: {' '.join(text[-300:].split())}")
        return
    ok, line = metrics_line(Path(runs) / "moe" / "metrics.jsonl")
    report(
        "moe_compile",
        ok,
        f"{line} graph_breaks={text.count('Graph break')} recompiles={text.count('Recompiling')}",
    )


class _Syncs:
    """Counts, around a block, the synchronizing CUDA calls `torch.cuda.set_sync_debug_mode` reports
    (CUDA only) and the host reads d9d's HostSyncCounter sees (`.item()`, `.tolist()`, ...)."""

    def __enter__(self) -> "_Syncs":
        from d9d.mesh.testing import HostSyncCounter

        self._reads = HostSyncCounter().__enter__()
        self._warnings = warnings.catch_warnings(record=True)
        self._seen = self._warnings.__enter__()
        warnings.simplefilter("always")
        if CUDA:
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)
        self._reads.__exit__(*exc)
        self.reads = self._reads.count
        self.cuda = sum("synchroniz" in str(w.message) for w in self._seen) if CUDA else None


def _syncs_of_run(steps: int, extra: list[str], save_dir: str) -> tuple[int | None, int]:
    from d9d.trainer import Trainer

    sets = [f"trainer.device={DEVICE.type}", f"trainer.schedule.total_steps={steps}", "trainer.run.name=syncs",
            f"trainer.checkpointing.save_dir={save_dir}", "trainer.checkpointing.period_steps=0",
            "trainer.logging.period_steps=1000", "trainer.logging.progress_bar=false", "optimizer.implementation=fused", *([] if CUDA else TINY), *extra]  # fmt: skip
    with Trainer.from_config(QUICKSTART[1], sets) as trainer, _Syncs() as syncs:
        trainer.train()
    return syncs.cuda, syncs.reads


def check_syncs() -> None:
    """Host syncs per ordinary step (no log line, no checkpoint) of the quickstart, dense and MoE: runs
    of 4 and 12 steps that log and save only at their end differ by 8 such steps. d9d's claim is one
    (its non-finite check) with fused AdamW (what `optimizer.implementation: auto` picks on CUDA; set
    here on CPU too, where auto's foreach AdamW reads its step counters on the host)."""
    lines, passed = [], True
    for name, extra in (("dense", []), ("moe", MOE)):
        with tempfile.TemporaryDirectory() as tmp:
            (cuda4, reads4), (cuda12, reads12) = (_syncs_of_run(n, extra, f"{tmp}/{n}") for n in (4, 12))
        reads = (reads12 - reads4) / 8
        cuda = (cuda12 - cuda4) / 8 if cuda12 is not None and cuda4 is not None else None
        passed &= reads <= 1 and (cuda is None or cuda <= 1)
        lines.append(f"{name}: cuda_syncs_per_step={cuda} host_reads_per_step={reads:g}")
    report("syncs", passed, " | ".join(lines) + " (target: 1 a step, the non-finite check)")


#: The RESULT name of a check where it differs from the argument.
RESULT_NAMES = {"cp": "cp_attention", "flex": "flex_docmask"}


def _checks() -> dict[str, Callable[..., None]]:
    from gpu_check_fsdp import check_fsdp, check_offload

    return {
        "env": check_env,
        "dtypes": check_dtypes,
        "cp": check_cp,
        "flex": check_flex,
        "syncs": check_syncs,
        "quickstart": check_quickstart,
        "moe_compile": check_moe_compile,
        "fsdp": lambda: check_fsdp(False),
        "fsdp_compiled": lambda: check_fsdp(True),
        "cpu_offload": check_offload,
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    checks = _checks()
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in checks:
        sys.exit(f"usage: gpu_check.py {{{'|'.join(checks)}}} [ARG]")
    try:
        checks[name](*sys.argv[2:])
    except Exception as error:  # one line for the summary; the traceback stays in the check's log
        traceback.print_exc()
        first = (str(error).splitlines() or [""])[0][:200]
        report(RESULT_NAMES.get(name, name), False, f"{type(error).__name__}: {first}")
        sys.exit(1)
