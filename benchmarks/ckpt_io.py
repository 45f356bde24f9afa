"""Checkpoint and safetensors IO: peak memory of streaming export/import, and save/load throughput.

    OMP_NUM_THREADS=1 uv run python benchmarks/ckpt_io.py [--mb 400] [--shard-mb 50]

Every measurement runs in a fresh subprocess holding a model of `--mb` MB (fp32, 16 equal tensors).
Memory is the peak RSS above the RSS right after the model was built (the libraries are imported
and `os.sync()` has run before that, so neither import memory nor an earlier op's writeback is
counted). The streaming writer and reader of d9d.ckpt should stay near one shard plus one tensor; `safetensors.torch.save_file`/`load_file` and
`torch.save`/`torch.load` of the full state dict need about the whole model. Throughput compares
d9d's `CheckpointManager` (atomic commit, validation) with plain `torch.distributed.checkpoint`.
The cost of checksums is the save time of `CheckpointManager` over the same save with the read-back
crc32 of each written file replaced by a constant (`d9d_ckpt_save_nocrc`), and the load time with
`verify_on_load=True` (the default: checksums on a thread while the load reads) over the load with it off.

The same model sharded with FSDP2 over 2 forked gloo ranks (`--ranks`) is exported twice: with
`save_safetensors` (each shard is sent to rank 0 alone) and with torch's usual recipe,
`get_model_state_dict(full_state_dict=True, cpu_offload=True)` (an all-gather per tensor on every
rank, the full state kept on rank 0) followed by `save_file` on rank 0. Peak RSS is sampled on every
rank above its RSS after sharding; "writer" is rank 0, "other" the largest of the other ranks.
These two runs set `MALLOC_MMAP_THRESHOLD_=1MiB`: glibc otherwise raises its mmap threshold after
the first freed 25 MB tensor and keeps later ones in a heap it does not trim, so RSS would show
every tensor ever gathered (measured here: 100-250 MB, varying run to run) instead of what is live.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import MB, PeakSampler, Row, row, rss, write_rows


def _model(total_mb: int):  # type: ignore[no-untyped-def]
    import torch

    n = 16
    per = total_mb * MB // (4 * n)
    side = int(per**0.5)
    module = torch.nn.Module()
    for i in range(n):
        module.register_parameter(f"w{i:02d}", torch.nn.Parameter(torch.randn(side, side)))
    return module


def _child(op: str, folder: str, total_mb: int, shard_mb: int, ranks: int) -> None:
    if op.startswith("sharded_"):
        import torch.distributed.fsdp  # before the fork: each rank starts at once

        from d9d.mesh.testing import run_distributed

        results = run_distributed(_sharded_export, ranks, op, folder, total_mb, shard_mb, timeout=600)
        print(
            json.dumps(
                {
                    "op": op,
                    "extra_mb": results[0][0],
                    "other_mb": max(r[0] for r in results[1:]),
                    "seconds": max(r[1] for r in results),
                }
            )
        )
        return

    import safetensors.torch  # noqa: F401  (imported before the baseline: their memory is not the op's)
    import torch.distributed.checkpoint  # noqa: F401

    import d9d.ckpt  # noqa: F401

    model = _model(total_mb)
    os.sync()  # no dirty pages of an earlier op are flushed during this one
    base = rss()
    with PeakSampler() as sampler:
        seconds = _do(op, model, folder, shard_mb)
    print(json.dumps({"op": op, "extra_mb": max(0, sampler.peak - base) / MB, "seconds": seconds}))


def _do(op: str, model, folder: str, shard_mb: int) -> float:  # type: ignore[no-untyped-def]
    import torch
    from safetensors.torch import load_file, save_file

    from d9d.ckpt import CheckpointManager, load_safetensors, save_safetensors

    start = time.perf_counter()
    if op == "d9d_export":
        save_safetensors(model, folder, max_shard_size=shard_mb * MB)
    elif op == "save_file":
        save_file({k: v.detach() for k, v in model.state_dict().items()}, f"{folder}/model.safetensors")
    elif op == "torch_save":
        torch.save(model.state_dict(), f"{folder}/model.pt")
    elif op == "d9d_import":
        load_safetensors(model, folder)
    elif op == "load_file":
        model.load_state_dict(load_file(f"{folder}/model.safetensors"))
    elif op == "torch_load":
        model.load_state_dict(torch.load(f"{folder}/model.pt"))
    elif op in ("d9d_ckpt_save", "d9d_ckpt_save_nocrc"):
        if op == "d9d_ckpt_save_nocrc":  # the same save, the read-back checksum left out
            from d9d.ckpt.checkpoint import integrity

            integrity.checksum_file = lambda path: "crc32:00000000"
        with CheckpointManager(folder, f"bench-{op}") as manager:
            manager.save(1, model)
    elif op == "dcp_save":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{folder}/dcp", no_dist=True)
    elif op in ("d9d_ckpt_load", "d9d_ckpt_load_verify"):
        with CheckpointManager(
            folder, "bench-d9d_ckpt_save", verify_on_load=op.endswith("verify")
        ) as manager:
            manager.load(None, model)
    elif op == "dcp_load":
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=f"{folder}/dcp", no_dist=True)
    return time.perf_counter() - start


def _sharded_export(op: str, folder: str, total_mb: int, shard_mb: int) -> tuple[float, float]:
    """One rank: shard the model with FSDP2, export it; (peak RSS extra in MB, seconds)."""
    import gc

    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from d9d.ckpt import save_safetensors

    model = _model(total_mb)
    fully_shard(model)
    gc.collect()
    os.sync()
    dist.barrier()
    base = rss()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        if op == "sharded_d9d_export":
            save_safetensors(model, folder, max_shard_size=shard_mb * MB)
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)
            if dist.get_rank() == 0:
                safetensors.torch.save_file(state, f"{folder}/model.safetensors")
            del state
            dist.barrier()
    return max(0, sampler.peak - base) / MB, time.perf_counter() - start


def _run(op: str, folder: str, args: argparse.Namespace) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            op,
            "--folder",
            folder,
            "--mb",
            str(args.mb),
            "--shard-mb",
            str(args.shard_mb),
            "--ranks",
            str(args.ranks),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MB)} if op.startswith("sharded_") else None,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--shard-mb", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks of the sharded export")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--child")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.folder, args.mb, args.shard_mb, args.ranks)
        return
    tensor_mb = args.mb / 16
    with tempfile.TemporaryDirectory() as d9d_dir, tempfile.TemporaryDirectory() as plain_dir:
        rows = [_run(op, d9d_dir if op.startswith("d9d") else plain_dir, args) for op in (
            "d9d_export", "save_file", "torch_save", "d9d_import", "load_file", "torch_load",
            "d9d_ckpt_save_nocrc", "d9d_ckpt_save", "dcp_save", "d9d_ckpt_load", "d9d_ckpt_load_verify",
            "dcp_load",
            "sharded_d9d_export", "sharded_full_state_dict",
        )]  # fmt: skip
    by_op = {r["op"]: r for r in rows}
    print(f"model {args.mb} MB in 16 tensors of {tensor_mb:.0f} MB; shard size {args.shard_mb} MB")
    print(f"{'operation':<24} {'peak extra MB':>14} {'seconds':>9}")
    for r in rows:
        other = f" (other ranks {r['other_mb']:.0f})" if "other_mb" in r else ""
        print(f"{r['op']:<24} {r['extra_mb']:>14.0f} {r['seconds']:>9.2f}{other}")
    budget = args.shard_mb + tensor_mb
    ex, im, sf = by_op["d9d_export"], by_op["d9d_import"], by_op["save_file"]
    ratios: list[Row] = [
        row("streaming export peak extra / (shard + tensor)", ex["extra_mb"] / budget, "<= 1",
            f"{ex['extra_mb']:.0f} MB; model {args.mb} MB"),
        row("streaming import peak extra / (shard + tensor)", im["extra_mb"] / budget, "<= 1",
            f"{im['extra_mb']:.0f} MB; load_file: {by_op['load_file']['extra_mb']:.0f} MB"),
        row("save_file peak extra / model size", sf["extra_mb"] / args.mb, "(baseline)"),
        row("d9d export / save_file time", ex["seconds"] / sf["seconds"], "<= 1"),
        row("d9d import / load_file time", im["seconds"] / by_op["load_file"]["seconds"], "<= 1"),
        row("CheckpointManager / plain DCP save time",
            by_op["d9d_ckpt_save"]["seconds"] / by_op["dcp_save"]["seconds"], "~1 (+ commit, fsync)"),
        row("CheckpointManager / plain DCP load time",
            by_op["d9d_ckpt_load"]["seconds"] / by_op["dcp_load"]["seconds"], "~1 (+ validation)"),
        row("save time with / without checksums (crc32 read-back)",
            by_op["d9d_ckpt_save"]["seconds"] / by_op["d9d_ckpt_save_nocrc"]["seconds"], "~1",
            f"{by_op['d9d_ckpt_save']['seconds']:.2f} vs {by_op['d9d_ckpt_save_nocrc']['seconds']:.2f} s"),
        row("load time with / without verify_on_load",
            by_op["d9d_ckpt_load_verify"]["seconds"] / by_op["d9d_ckpt_load"]["seconds"], "~1 (concurrent)"),
    ]  # fmt: skip
    sx, fs = by_op["sharded_d9d_export"], by_op["sharded_full_state_dict"]
    ratios += [
        row(f"FSDP {args.ranks} export: writer peak extra / (shard + tensor)", sx["extra_mb"] / budget, "<= 1",
            f"{sx['extra_mb']:.0f} MB; full_state_dict recipe: {fs['extra_mb']:.0f} MB"),
        row(f"FSDP {args.ranks} export: other ranks' peak extra / tensor", sx["other_mb"] / tensor_mb,
            "-> 0 (only its own shard)", f"{sx['other_mb']:.0f} MB; all-gather recipe: {fs['other_mb']:.0f} MB"),
        row(f"FSDP {args.ranks} export: d9d / full_state_dict + save_file time", sx["seconds"] / fs["seconds"],
            "<= 1", f"{sx['seconds']:.2f} vs {fs['seconds']:.2f} s"),
    ]  # fmt: skip
    for r in ratios:
        print(f"{r['name']}: {r['ratio']:.2f} (ideal {r['ideal']}) {r['note']}")
    write_rows(args.json, ratios)


if __name__ == "__main__":
    main()
