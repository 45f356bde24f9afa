"""The GPU check's FSDP2 checks on a one-rank mesh (run through gpu_check.py: `fsdp`, `fsdp_compiled`,
`cpu_offload`): what FSDP2 changes against the same model and batches on one device without it.

One rank shards nothing, so what these measure is FSDP2's own cost on the device (its hooks, the bf16
all-gather copy, the DTensor optimizer step) and its dtypes, not a speed-up.
"""

import contextlib
import os
import statistics
import time

import torch
import torch.nn.functional as F
from gpu_check import CUDA, DEVICE, reference_model, report, synchronize

#: Steps per run; the step time is the median of those after the first (which compiles and warms up).
STEPS = 5


def _one_rank_mesh() -> object:
    """A one-rank process group (NCCL on CUDA) and its `dp_shard` mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if CUDA:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    return init_device_mesh(DEVICE.type, (1,), mesh_dim_names=("dp_shard",))


def _shard(model: torch.nn.Module, mesh: object, offload: bool) -> None:
    """fully_shard on the one-rank mesh (parallelize_hsdp skips axes of size 1: one rank needs no FSDP,
    but these checks are about FSDP2's path): bf16 all-gather, fp32 reduce-scatter, d9d's units."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from d9d.parallel.data_parallel import _apply
    from d9d.trainer.models import shard_units

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


def _train(mesh: object | None, compiled: bool, hidden: int, seq: int) -> dict[str, object]:
    """STEPS AdamW steps of a reference model with full activation checkpointing: sharded on `mesh`
    (FSDP2's bf16 weights), or on one device under bf16 autocast (None); per-block compile if asked."""
    from d9d.parallel import (
        ActivationCheckpointingConfig,
        CompileConfig,
        apply_activation_checkpointing,
        clip_grad_norm_,
        compile_blocks,
    )
    from d9d.trainer import materialize_and_initialize

    torch.manual_seed(0)
    model = reference_model(
        hidden, 4 if CUDA else 2, 16 if CUDA else 4, 4 if CUDA else 2, 32000 if CUDA else 512, seq
    )
    layers = list(model.model.layers.values())
    apply_activation_checkpointing(layers, ActivationCheckpointingConfig(mode="full"))
    if compiled:
        compile_blocks(layers, CompileConfig(enabled=True))
    if mesh is not None:
        _shard(model, mesh, offload=False)
    materialize_and_initialize(model, DEVICE, 0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if CUDA else {}))
    # on the head, which no compiled block holds: a hook inside a compiled block would recompile it
    forward_dtypes: list[torch.dtype] = []
    model.lm_head.register_forward_pre_hook(lambda module, args: forward_dtypes.append(module.weight.dtype))
    generator = torch.Generator().manual_seed(1)
    losses, times, grad_dtypes = [], [], set()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(STEPS):
        ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=generator).to(DEVICE)
        synchronize()
        start = time.perf_counter()
        autocast = torch.autocast(DEVICE.type, torch.bfloat16) if mesh is None else contextlib.nullcontext()
        with autocast:
            logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        grad_dtypes |= {str(p.grad.dtype).removeprefix("torch.") for p in params if p.grad is not None}
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"losses": losses, "step_s": statistics.median(times[1:]), "first_s": times[0],
            "forward": str(forward_dtypes[0]).removeprefix("torch."), "grads": sorted(grad_dtypes),
            "param": f"{type(params[0]).__name__}/{str(params[0].dtype).removeprefix('torch.')}",
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0}  # fmt: skip


def check_fsdp(compiled: bool) -> None:
    """FSDP2 on a one-rank mesh (NCCL on CUDA) against the same model, init and batches on one device
    without it: bf16 weights in forward, fp32 DTensor master weights and gradients, losses within bf16
    noise of the local run; the step time and peak memory of both give FSDP2's overhead. With
    `compiled`, every block is compiled in both runs and the graphs are counted."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    hidden, seq = (2048, 4096) if CUDA else (64, 64)
    local = _train(None, compiled, hidden, seq)
    graphs = counters["stats"]["unique_graphs"]
    mesh = _one_rank_mesh()
    sharded = _train(mesh, compiled, hidden, seq)
    gap = max(abs(a - b) / abs(b) for a, b in zip(sharded["losses"], local["losses"], strict=True))  # type: ignore[call-overload]
    passed = (
        all(x == x for x in sharded["losses"])  # type: ignore[attr-defined]
        and sharded["param"] == "DTensor/float32"
        and sharded["forward"] == "bfloat16"
        and sharded["grads"] == ["float32"]
        and gap < 2e-2
    )
    extra = ""
    if compiled:
        extra = f" unique_graphs(local,fsdp)={graphs},{counters['stats']['unique_graphs'] - graphs}"
        extra += f" graph_breaks={sum(counters['graph_break'].values())}"
    report(
        "fsdp_compiled" if compiled else "fsdp",
        passed,
        f"param={sharded['param']} forward_weight={sharded['forward']} grads={sharded['grads']} "
        f"loss_gap_vs_local={gap:.1e} step_ms(local,fsdp)={local['step_s'] * 1e3:.1f},"  # type: ignore[operator]
        f"{sharded['step_s'] * 1e3:.1f} fsdp/local={sharded['step_s'] / local['step_s']:.3f} "  # type: ignore[operator]
        f"first_step_ms(local,fsdp)={local['first_s'] * 1e3:.0f},{sharded['first_s'] * 1e3:.0f} "  # type: ignore[operator]
        f"peak_gib(local,fsdp)={local['peak_gib']:.2f},{sharded['peak_gib']:.2f}{extra}",
    )
    dist.destroy_process_group()


def _offload_run(mesh: object, offload: bool, hidden: int, seq: int) -> dict[str, object]:
    """Four AdamW steps of a reference model fully sharded on a one-rank mesh, with or without CPU offload."""
    from d9d.parallel import clip_grad_norm_, fsdp_parameters
    from d9d.trainer import materialize_and_initialize

    torch.manual_seed(0)
    with torch.device("meta"):
        model = reference_model(
            hidden, 4 if CUDA else 2, 16 if CUDA else 4, 4 if CUDA else 2, 32000 if CUDA else 512, seq
        )
    _shard(model, mesh, offload)
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

    mesh = _one_rank_mesh()
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
