"""d9d's checks of the CUDA paths CPU tests cannot reach (run by benchmarks/gpu_check.sh).

    python benchmarks/gpu_check.py CHECK      # CHECK: env | dtypes | cp | flex | fsdp | fsdp_compiled | cpu_offload

Each check prints one `RESULT <check> <PASS|FAIL|INFO> <details>` line. On a GPU the shapes are
the real ones (hidden 2048, seq 4096-8192); with `DEVICE=cpu` (or no GPU) they shrink and the check
runs the same code as a dry run: it catches Python errors and the dtype contract, and proves
nothing about CUDA kernels. Uses the packages' public API, plus two context-parallel helpers, the
FSDP application (to shard on one rank) and the trainer's peak-FLOPs table.
"""

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

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

    info: dict[str, object] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(DEVICE)}
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
        )
    info["peak_bf16_tflops"] = (device_peak_flops(DEVICE) or 0) / 1e12
    report("env", None, json.dumps(info))


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
    """Document masks: the auto backend (FlexAttention on CUDA) equals masked SDPA, forward and
    backward, over four batches of different document layouts; the compiles it cost are counted."""
    from torch._dynamo.utils import counters

    from d9d.parallel import DocumentMask

    torch.manual_seed(0)
    batch, seq, heads, kv_heads, head_dim = (2, 4096, 16, 4, 128) if CUDA else (1, 256, 4, 2, 16)
    dtype = torch.bfloat16 if CUDA else torch.float32
    lines, passed, times = [], True, []
    for layout in range(4):
        cuts = (
            torch.randint(1, seq, (batch, 6), generator=torch.Generator().manual_seed(layout)).sort(-1).values
        )
        documents = (torch.arange(seq)[None, None, :] >= cuts[:, :, None]).sum(1).to(DEVICE)
        q = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
        grad = torch.randn(batch, heads, seq, head_dim, device=DEVICE, dtype=dtype)
        start = time.perf_counter()
        mask = DocumentMask(documents)
        out = mask.attention(q, k, v)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
        synchronize()
        times.append(time.perf_counter() - start)
        ref = DocumentMask(documents, backend="sdpa").attention(q, k, v)
        want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
        errors = [
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(got, want, strict=True)
        ]
        good = max(errors) < (3e-2 if dtype == torch.bfloat16 else 1e-4)
        passed &= good
        if layout in (0, 3):
            lines.append(
                f"layout{layout} backend={mask.backend} rel err={','.join(f'{e:.1e}' for e in errors)} {'ok' if good else 'BAD'}"
            )
    graphs = counters["stats"]["unique_graphs"]
    lines.append(f"unique_graphs={graphs} ms(first,last)={times[0] * 1e3:.0f},{times[-1] * 1e3:.1f}")
    report("flex_docmask", passed, " | ".join(lines))


def check_fsdp(compiled: bool) -> None:
    """FSDP2 on a one-rank mesh (NCCL on CUDA): bf16 weights in forward, fp32 master weights and
    gradients, d9d's clip over DTensors, AdamW (fused on CUDA), full activation checkpointing, and
    per-block compile when `compiled`; embedding and [norm, lm_head] are their own FSDP units."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from d9d.parallel import (
        ActivationCheckpointingConfig,
        CompileConfig,
        apply_activation_checkpointing,
        clip_grad_norm_,
        compile_blocks,
    )
    from d9d.parallel.data_parallel import _apply
    from d9d.trainer import materialize_and_initialize
    from d9d.trainer.models import shard_units

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + (7 if compiled else 3)))
    if CUDA:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh(DEVICE.type, (1,), mesh_dim_names=("dp_shard",))
    hidden, seq = (2048, 4096) if CUDA else (64, 64)
    model = reference_model(
        hidden, 4 if CUDA else 2, 16 if CUDA else 4, 4 if CUDA else 2, 32000 if CUDA else 512, seq
    )
    layers = list(model.model.layers.values())
    apply_activation_checkpointing(layers, ActivationCheckpointingConfig(mode="full"))
    if compiled:
        compile_blocks(layers, CompileConfig(enabled=True))
    # fully_shard on a one-rank mesh (parallelize_hsdp skips axes of size 1: one rank needs no FSDP,
    # but this check is about FSDP2's CUDA path: bf16 all-gather, fp32 reduce-scatter, DTensor optimizer)
    _apply(
        model,
        mesh,
        ["dp_shard"],
        [],
        blocks=shard_units(model),
        mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        reshard_after_forward=None,
        gradient_reduction="sum",
        ignored_params=set(),
    )
    materialize_and_initialize(model, DEVICE, 0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=CUDA)
    forward_dtypes: list[torch.dtype] = []
    layers[0].mlp.gate_proj.register_forward_pre_hook(
        lambda module, args: forward_dtypes.append(module.weight.dtype)
    )
    losses, times, grad_dtypes = [], [], set()
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (1, seq), device=DEVICE)
        synchronize()
        start = time.perf_counter()
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        grad_dtypes |= {str(p.grad.dtype) for p in params if p.grad is not None}
        norm = clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    extra = ""
    if compiled:
        from torch._dynamo.utils import counters

        extra = f" graph_breaks={sum(counters['graph_break'].values())} unique_graphs={counters['stats']['unique_graphs']}"
    peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0
    passed = (
        all(x == x for x in losses)
        and isinstance(params[0], DTensor)
        and params[0].dtype == torch.float32
        and forward_dtypes[:1] == [torch.bfloat16]
        and grad_dtypes == {"torch.float32"}
    )
    report(
        "fsdp_compiled" if compiled else "fsdp",
        passed,
        f"param={type(params[0]).__name__}/{params[0].dtype} forward_weight={forward_dtypes[:1]} grads={sorted(grad_dtypes)} "
        f"norm={float(norm):.3g} losses={[round(x, 3) for x in losses]} step_ms(first,last)={times[0] * 1e3:.0f},"
        f"{times[-1] * 1e3:.1f} peak_gib={peak:.1f}{extra}",
    )
    dist.destroy_process_group()


def _offload_run(mesh: object, offload: bool, hidden: int, seq: int) -> dict[str, object]:
    """Four AdamW steps of a reference model fully sharded on a one-rank mesh, with or without CPU offload."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from d9d.parallel import clip_grad_norm_, fsdp_parameters
    from d9d.parallel.data_parallel import _apply
    from d9d.trainer import materialize_and_initialize
    from d9d.trainer.models import shard_units

    torch.manual_seed(0)
    with torch.device("meta"):
        model = reference_model(
            hidden, 4 if CUDA else 2, 16 if CUDA else 4, 4 if CUDA else 2, 32000 if CUDA else 512, seq
        )
    _apply(
        model,
        mesh,  # type: ignore[arg-type]
        ["dp_shard"],
        [],
        blocks=shard_units(model),
        mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        reshard_after_forward=None,
        gradient_reduction="sum",
        ignored_params=set(),
        cpu_offload=offload,
    )
    materialize_and_initialize(model, DEVICE, 0, init_device="cpu")
    params = list(model.parameters())
    on_host = all(p.to_local().device.type == "cpu" for p in params)
    pinned = all(p.to_local().is_pinned() for p in params) if CUDA else None
    optimizer = torch.optim.AdamW(
        params, lr=1e-4, **({"fused": True} if CUDA and not offload else {"foreach": True})
    )
    generator = torch.Generator().manual_seed(1)
    losses, times, between = [], [], []
    for _ in range(4):
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=generator).to(DEVICE)
        synchronize()
        start = time.perf_counter()
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
        loss.backward()
        grads_on_host = all(p.grad is not None and p.grad.to_local().device.type == "cpu" for p in params)
        norm = clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        between.append(torch.cuda.memory_allocated() if CUDA else 0)  # what stays on the device between steps
    state_on_host = all(
        v.device.type == "cpu"
        for p in params
        for v in optimizer.state[p].values()
        if torch.is_tensor(v) and v.dim()
    )
    return {"losses": losses, "times": times, "between": between[-1], "on_host": on_host, "pinned": pinned,
            "grads_on_host": grads_on_host, "state_on_host": state_on_host, "norm_device": norm.device.type,
            "offloaded": len(fsdp_parameters(model, offloaded=True)), "params": len(params)}  # fmt: skip


def check_offload() -> None:
    """CPU offload (`cpu_offload=True`, FSDP2's CPUOffloadPolicy) on a one-rank mesh against the same
    run without it: d9d's materialization puts every sharded parameter in pinned host memory, gradients
    and AdamW state stay there, the grad norm comes back on the GPU, the losses agree, and the device
    memory between steps (torch.cuda.memory_allocated) and the step time are compared."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if CUDA:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh(DEVICE.type, (1,), mesh_dim_names=("dp_shard",))
    hidden, seq = (2048, 2048) if CUDA else (64, 64)
    plain = _offload_run(mesh, False, hidden, seq)
    offloaded = _offload_run(mesh, True, hidden, seq)
    gap = max(abs(a - b) / abs(b) for a, b in zip(offloaded["losses"], plain["losses"], strict=True))  # type: ignore[arg-type]
    time_ratio = sorted(offloaded["times"])[2] / sorted(plain["times"])[2]  # type: ignore[index]
    passed = (
        offloaded["on_host"] is True
        and offloaded["pinned"] in (True, None)
        and offloaded["grads_on_host"] is True
        and offloaded["state_on_host"] is True
        and offloaded["norm_device"] == DEVICE.type
        and offloaded["offloaded"] == offloaded["params"]
        and plain["offloaded"] == 0
        and gap < 1e-2
        and (not CUDA or offloaded["between"] < plain["between"])  # type: ignore[operator]
    )
    report(
        "cpu_offload",
        passed,
        f"host/pinned/grads/state on host={offloaded['on_host']}/{offloaded['pinned']}/{offloaded['grads_on_host']}/"
        f"{offloaded['state_on_host']} norm_on={offloaded['norm_device']} loss_gap={gap:.2e} "
        f"device_bytes_between_steps(off,on)={plain['between']:,},{offloaded['between']:,} "
        f"step_time(on/off)={time_ratio:.2f}",
    )
    dist.destroy_process_group()


#: The RESULT name of a check where it differs from the argument.
RESULT_NAMES = {"cp": "cp_attention", "flex": "flex_docmask"}

CHECKS: dict[str, Callable[[], None]] = {
    "env": check_env,
    "dtypes": check_dtypes,
    "cp": check_cp,
    "flex": check_flex,
    "fsdp": lambda: check_fsdp(False),
    "fsdp_compiled": lambda: check_fsdp(True),
    "cpu_offload": check_offload,
}

if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else ""
    if name not in CHECKS:
        sys.exit(f"usage: gpu_check.py {{{'|'.join(CHECKS)}}}")
    try:
        CHECKS[name]()
    except Exception as error:  # one line for the summary; the traceback stays in the check's log
        traceback.print_exc()
        first = (str(error).splitlines() or [""])[0][:200]
        report(RESULT_NAMES.get(name, name), False, f"{type(error).__name__}: {first}")
        sys.exit(1)
