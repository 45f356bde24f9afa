"""Hugging Face export/import through d9d.ckpt against transformers' save_pretrained/from_pretrained.

    OMP_NUM_THREADS=1 uv run python benchmarks/hf_io.py [--layers 8] [--shard-mb 100] [--repeats 1]

The model is a Qwen3 built locally from a config (fp32, ~400 MB at the default sizes; nothing is
downloaded): the reference model (`d9d.trainer.models`), whose HF layout is Qwen3ForCausalLM.
A setup subprocess writes the same weights twice: folder D with d9d (`save_hf_pretrained`) and
folder H with transformers (`from_pretrained(D)` then `save_pretrained`). Then each operation runs in
a fresh subprocess, torch and transformers already imported, after `os.sync()`:

- d9d export: `save_hf_pretrained` (= `d9d.ckpt.save_safetensors` through `hf_export_mapper`) of a
  built reference model into a new folder.
- HF save: `Qwen3ForCausalLM.from_pretrained(D)` (not measured), then `save_pretrained` into a new folder.
- d9d import: build the reference model on meta, `to_empty`, then `load_hf_pretrained` (=
  `d9d.ckpt.load_safetensors` through the inverse mapper) from H, the folder transformers wrote.
- HF load: `AutoModelForCausalLM.from_pretrained(D)`, the folder d9d wrote.

Both loads then read every weight once (a model is usable only when its weights are in memory;
a memory-mapped load defers the reading to first use), inside the timed and sampled region.
Both sides write shards of `--shard-mb`. Memory is the peak RSS (sampled every ms) above the RSS
before the operation: for the saves the model already exists, so "extra" is what saving costs; for
the loads the model is built inside the operation, so the peak includes the model itself (its size
is printed). RSS counts mmapped file pages too. The files sit in the page cache (just written), so
loads measure copying, not the disk. Rounds alternate the order of the four operations. Times are
wall seconds, noisy (±15%) on a shared CPU machine.
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
from typing import TYPE_CHECKING

from _common import MB, PeakSampler, Row, row, rss, write_rows

if TYPE_CHECKING:
    import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]

OPS = ("d9d_export", "hf_save", "d9d_import", "hf_load")


def _config(layers: int):  # type: ignore[no-untyped-def]
    from d9d.trainer.models import ReferenceModelConfig

    return ReferenceModelConfig(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
    )


def _touch(model: "torch.nn.Module") -> None:
    """Read every weight once: a model is only usable once its weights are in memory (mmap defers that)."""
    import torch

    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.sum()


def _child(op: str, folders: dict[str, str], layers: int, shard_mb: int) -> dict[str, float | str]:
    import torch
    import transformers

    from d9d.trainer.models import ReferenceForCausalLM, load_hf_pretrained, save_hf_pretrained

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = _config(layers)
    shard = shard_mb * MB
    model: torch.nn.Module | None = None
    if op in ("setup", "d9d_export"):
        torch.manual_seed(0)
        model = ReferenceForCausalLM(config)
    elif op == "hf_save":
        model = transformers.AutoModelForCausalLM.from_pretrained(folders["d9d"])
        _touch(model)
    if op == "setup":  # the folders the loads read: one written by each side, from the same weights
        save_hf_pretrained(model, folders["d9d"], max_shard_size=shard)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folders["d9d"])
        hf_model.save_pretrained(folders["hf"], max_shard_size=shard)
        return {"op": op}
    os.sync()  # no dirty pages of an earlier op are flushed during this one
    base = rss()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        if op == "d9d_export":
            assert isinstance(model, ReferenceForCausalLM)
            save_hf_pretrained(model, folders["out"], max_shard_size=shard)
        elif op == "hf_save":
            assert isinstance(model, transformers.PreTrainedModel)
            model.save_pretrained(folders["out"], max_shard_size=shard)
        elif op == "d9d_import":  # reads the folder transformers wrote
            with torch.device("meta"):
                model = ReferenceForCausalLM(config)
            model.to_empty(device="cpu")
            load_hf_pretrained(model, folders["hf"])
            _touch(model)
        elif op == "hf_load":  # reads the folder d9d wrote
            model = transformers.AutoModelForCausalLM.from_pretrained(folders["d9d"])
            _touch(model)
        seconds = time.perf_counter() - start
    assert model is not None
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"op": op, "extra_mb": (sampler.peak - base) / MB, "seconds": seconds, "model_mb": size / MB}


def _run(op: str, folders: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", op, "--folders", json.dumps(folders)]
    command += ["--layers", str(args.layers), "--shard-mb", str(args.shard_mb)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all four ops; medians reported")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--child")
    parser.add_argument("--folders")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, json.loads(args.folders), args.layers, args.shard_mb)))
        return
    runs: dict[str, list[dict[str, float]]] = {op: [] for op in OPS}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"d9d": f"{tmp}/by_d9d", "hf": f"{tmp}/by_hf"}
        _run("setup", folders, args)
        for i in range(args.repeats):
            for op in OPS if i % 2 == 0 else OPS[::-1]:  # alternate the order between rounds
                runs[op].append(_run(op, folders | {"out": f"{tmp}/out_{op}_{i}"}, args))
    med = {op: {k: statistics.median(r[k] for r in rs) for k in ("extra_mb", "seconds", "model_mb")}
           for op, rs in runs.items()}  # fmt: skip
    model_mb = med["d9d_export"]["model_mb"]
    print(
        f"Qwen3 reference model, {args.layers} layers, {model_mb:.0f} MB fp32; shards of {args.shard_mb} MB; "
        f"median of {args.repeats}"
    )
    print(f"{'operation':<12} {'peak extra MB':>14} {'seconds':>9}")
    for op in OPS:
        print(f"{op:<12} {med[op]['extra_mb']:>14.0f} {med[op]['seconds']:>9.2f}")
    d9d_e, hf_e = med["d9d_export"], med["hf_save"]
    d9d_i, hf_i = med["d9d_import"], med["hf_load"]
    export_ideal = f"<= {args.shard_mb / model_mb:.2f} (one shard)"
    rows: list[Row] = [
        row("HF export: d9d / save_pretrained time", d9d_e["seconds"] / hf_e["seconds"], "<= 1"),
        row("HF export: d9d peak extra / model size", d9d_e["extra_mb"] / model_mb, export_ideal,
            f"{d9d_e['extra_mb']:.0f} MB of {model_mb:.0f}"),
        row("HF export: save_pretrained peak extra / model size", hf_e["extra_mb"] / model_mb, "(baseline)",
            f"{hf_e['extra_mb']:.0f} MB of {model_mb:.0f}"),
        row("HF import: d9d / from_pretrained time", d9d_i["seconds"] / hf_i["seconds"], "<= 1",
            "each incl. model build and reading every weight"),
        row("HF import: d9d / from_pretrained peak", d9d_i["extra_mb"] / hf_i["extra_mb"], "<= 1",
            f"{d9d_i['extra_mb']:.0f} vs {hf_i['extra_mb']:.0f} MB, incl. the model"),
        row("HF import: d9d peak / model size", d9d_i["extra_mb"] / model_mb,
            f"<= {1 + args.shard_mb / model_mb:.2f} (model + shard)"),
    ]  # fmt: skip
    for r in rows:
        print(f"{r['name']}: {r['ratio']:.2f} (ideal {r['ideal']}) {r['note']}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
