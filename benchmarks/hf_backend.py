"""The Hugging Face backend (`d9d.trainer.hf`): its step time against the reference model, and the
import's peak memory per rank under FSDP against transformers' `from_pretrained` on one process.

    OMP_NUM_THREADS=1 uv run python benchmarks/hf_backend.py [--steps 30] [--rounds 2] [--ranks 2]
    OMP_NUM_THREADS=1 uv run python benchmarks/hf_backend.py --tiny     # a smoke test (a test runs it)

Both models are Llama: transformers' `LlamaConfig` saved locally by `save_pretrained` (nothing is
downloaded), which the reference model computes exactly (`d9d.trainer.models`).

Step time: the same job through `d9d.trainer.Trainer` twice per round, alternating, one process:
`d9d.trainer.hf:HFCausalLMProvider` (transformers' modeling code, sdpa) and the fine-tune example's
`HFModelProvider` (the reference model, the `model.backend: reference` path), from the same folder,
on the same batches of the repository's corpus (bytes, seq `--seq`), AdamW. The median
`step_time_s` of `metrics.jsonl` after warm-up (the last step, which checkpoints, left out).

Import memory, each in a fresh process, libraries imported and the model's modeling code loaded
before the baseline, `os.sync()` run first (see benchmarks/README.md):
- HF backend, FSDP `--ranks` (forked ranks over gloo): the trainer's own path, `Trainer.from_config`
  (the model built on the meta device, sharded by FSDP2 per decoder layer, materialized: each rank
  allocates its shards and initializes only what the folder does not hold, the rotary tables) and
  `Trainer.resume()` on a fresh run (the folder read through the provider's mapper by
  `load_safetensors`: each rank reads only its rows). The peak RSS above the baseline, the largest
  over the ranks, for the whole import and for its two parts: building the trainer, and reading the
  folder; and the peak of the anonymous part of RSS, the process's own memory without the pages of
  the memory-mapped shard file being read (page cache, which the kernel can drop).
- transformers: `AutoModelForCausalLM.from_pretrained(folder)` on one process, every weight read once.
The ideal is 1/N of the model plus one decoder layer. `--import-only` skips the step-time runs.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import MB, PeakSampler, Row, row, rss, write_rows

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"
CORPUS = ROOT / "examples" / "data" / "corpus.txt"
WARMUP = 3

#: (the step-time model, the import model): LlamaConfig keyword arguments.
SIZES: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "default": (
        {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4},
        {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_key_value_heads": 4},
    ),
    "tiny": (
        {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2},
        {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
}  # fmt: skip


def _save_llama(folder: Path, sizes: dict[str, int], shard_mb: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        **sizes, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size=f"{shard_mb}MB")


# ---------------------------------------------------------------------------------------- step time


def _job(backend: str, folder: Path, save_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    model: dict[str, Any]
    if backend == "hf":
        provider, model = "d9d.trainer.hf:HFCausalLMProvider", {"folder": str(folder)}
    else:
        provider, model = f"{FINETUNE}:HFModelProvider", {"hf_folder": str(folder), "backend": "reference"}
    return {
        "providers": {"model": provider, "dataset": f"{FINETUNE}:CorpusProvider"},
        "model": model,
        "dataset": {"path": str(CORPUS), "seq_len": args.seq},
        "data": {"global_batch_size": 8, "microbatch_size": 4},
        "trainer": {
            "run": {"name": backend},
            "schedule": {"total_steps": args.steps},
            "checkpointing": {"save_dir": str(save_dir), "period_steps": 0},
            "logging": {"period_steps": 10, "level": "WARNING"},
        },
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "lr_scheduler": {"name": "constant", "warmup_steps": 0},
    }


def _step_times(backend: str, folder: Path, args: argparse.Namespace) -> list[float]:
    from d9d.trainer import Trainer

    with (
        tempfile.TemporaryDirectory() as tmp,
        Trainer.from_config(_job(backend, folder, Path(tmp), args)) as trainer,
    ):
        trainer.train()
        lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step_time_s"] for line in lines][WARMUP:-1]


# ---------------------------------------------------------------------------------------- import memory


class _AnonPeakSampler(PeakSampler):
    """`PeakSampler` that also keeps the peak of RSS without its file-backed and shared pages
    (`anon_peak`: statm's resident - shared), i.e. without the memory-mapped files being read."""

    def __init__(self) -> None:
        self.anon_peak = _anon_rss()
        super().__init__()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            self.anon_peak = max(self.anon_peak, _anon_rss())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.anon_peak = max(self.anon_peak, _anon_rss())


def _anon_rss() -> int:
    with open("/proc/self/statm") as fh:
        fields = fh.read().split()
    return (int(fields[1]) - int(fields[2])) * resource.getpagesize()


def _import_job(folder: str, ranks: int, save_dir: str) -> dict[str, Any]:
    return {
        "providers": {"model": "d9d.trainer.hf:HFCausalLMProvider", "dataset": f"{FINETUNE}:CorpusProvider"},
        "mesh": {"data_parallel_shard": ranks},
        "model": {"folder": folder},
        "dataset": {"path": str(CORPUS), "seq_len": 32},
        "data": {"global_batch_size": ranks, "microbatch_size": 1},
        "trainer": {
            "run": {"name": "import"},
            "schedule": {"total_steps": 1},
            "checkpointing": {"save_dir": save_dir, "period_steps": 0},
            "logging": {"level": "WARNING"},
        },
    }


def _import_rank(folder: str, ranks: int, save_dir: str) -> dict[str, float]:
    """One rank of the HF backend's import on FSDP `ranks`: peak RSS above the baseline, by phase."""
    import torch

    from d9d.mesh import DistributedContext, MeshConfig
    from d9d.trainer import Trainer, load_job_config, resolve_job
    from d9d.trainer.providers import InitializeModelStageContext

    job = resolve_job(load_job_config(_import_job(folder, ranks, save_dir)))  # providers imported, built
    context = DistributedContext.from_env(MeshConfig(data_parallel_shard=ranks))
    with torch.device("meta"):  # once before the baseline: the modeling code and the mesh are loaded
        job.model_provider.initialize_model_stage(InitializeModelStageContext(context=context))
    context.barrier()
    os.sync()
    base, anon_base = rss(), _anon_rss()
    with _AnonPeakSampler() as whole:
        with PeakSampler() as build:
            trainer = Trainer(job)
        with PeakSampler() as read:
            trainer.resume()  # a fresh run: the folder's weights
    trainer.close()
    return {
        "whole": (whole.peak - base) / MB,
        "anon": (whole.anon_peak - anon_base) / MB,
        "build": (build.peak - base) / MB,
        "read": (read.peak - base) / MB,
    }


def _import_fsdp(folder: str, ranks: int) -> dict[str, float]:
    from d9d.mesh.testing import run_distributed

    with tempfile.TemporaryDirectory() as save_dir:
        per_rank = run_distributed(_import_rank, ranks, folder, ranks, save_dir, timeout=600)
    return {phase: max(r[phase] for r in per_rank) for phase in ("whole", "anon", "build", "read")}


def _from_pretrained(folder: str) -> dict[str, float]:
    import torch
    import transformers

    with torch.device("meta"):  # the modeling code loaded before the baseline
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    os.sync()
    base = rss()
    with PeakSampler() as sampler:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.sum()  # read every weight (a memory-mapped load defers it)
    return {"whole": (sampler.peak - base) / MB}


def _sizes_of(folder: str) -> dict[str, float]:
    """The model's fp32 bytes, its largest single module and one decoder layer (MB)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))

    def mb(module: Any) -> float:
        return sum(p.numel() * 4 for p in module.parameters()) / MB

    return {
        "model": mb(model),
        "layer": mb(model.model.layers[0]),
        "largest": max(mb(m) for m in model.modules() if not list(m.children())),
    }


def _child(op: str, folder: str, ranks: int) -> dict[str, float]:
    return _import_fsdp(folder, ranks) if op == "import_fsdp" else _from_pretrained(folder)


def _run_child(op: str, folder: Path, ranks: int) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", op, "--folder", str(folder), "--ranks", str(ranks)]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=30, help="steps per run (the first 3 and the last not timed)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each backend, alternating")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2, help="FSDP degree of the import")
    parser.add_argument(
        "--shard-mb", type=int, default=100, help="safetensors shard size of the saved folder"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, few steps (a smoke test)")
    parser.add_argument("--import-only", action="store_true", help="measure the import only, no step time")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--child")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.folder, args.ranks)))
        return
    if args.tiny:
        args.steps, args.rounds, args.seq, args.shard_mb = 6, 1, 32, 1
    import torch

    torch.set_num_threads(1)
    step_sizes, import_sizes = SIZES["tiny" if args.tiny else "default"]
    times: dict[str, list[float]] = {"hf": [], "reference": []}
    with tempfile.TemporaryDirectory() as tmp:
        step_folder, import_folder = Path(tmp) / "step", Path(tmp) / "import"
        _save_llama(import_folder, import_sizes, args.shard_mb)
        if not args.import_only:
            _save_llama(step_folder, step_sizes, args.shard_mb)
            for i in range(args.rounds):
                for backend in ("hf", "reference") if i % 2 == 0 else ("reference", "hf"):
                    times[backend] += _step_times(backend, step_folder, args)
        sizes = _sizes_of(str(import_folder))
        fsdp = _run_child("import_fsdp", import_folder, args.ranks)
        hf_load = _run_child("from_pretrained", import_folder, args.ranks)
    n = args.ranks
    rows: list[Row] = []
    if not args.import_only:
        hf, ref = statistics.median(times["hf"]), statistics.median(times["reference"])
        print(
            f"step time, Llama {step_sizes['num_hidden_layers']} layers hidden {step_sizes['hidden_size']}, seq {args.seq}:"
        )
        print(
            f"  HF backend {hf * 1e3:.1f} ms, reference model {ref * 1e3:.1f} ms (median of {len(times['hf'])} / {len(times['reference'])} steps)"
        )
        rows.append(row("HF backend / reference model step time", hf / ref, "~1",
                        f"{hf * 1e3:.0f} vs {ref * 1e3:.0f} ms, median of {len(times['hf'])} steps each"))  # fmt: skip
    print(
        f"import, Llama {import_sizes['num_hidden_layers']} layers hidden {import_sizes['hidden_size']}: model {sizes['model']:.0f} MB, "
        f"one decoder layer {sizes['layer']:.1f} MB, largest module {sizes['largest']:.1f} MB; shards of {args.shard_mb} MB"
    )
    print(
        f"  HF backend FSDP {n}, peak extra per rank: {fsdp['whole']:.0f} MB (building the trainer {fsdp['build']:.0f}, "
        f"reading the folder {fsdp['read']:.0f}); without the mapped file pages {fsdp['anon']:.0f} MB"
    )
    print(f"  transformers from_pretrained, one process: {hf_load['whole']:.0f} MB")
    ideal = f"<= {1 / n + sizes['layer'] / sizes['model']:.2f} (1/{n} + one layer)"
    rows += [
        row(f"HF import, FSDP {n}: peak per rank / model size", fsdp["whole"] / sizes["model"], ideal,
            f"{fsdp['whole']:.0f} of {sizes['model']:.0f} MB; one layer {sizes['layer']:.0f} MB, largest module {sizes['largest']:.0f} MB"),
        row(f"HF import, FSDP {n}: peak per rank / from_pretrained peak", fsdp["whole"] / hf_load["whole"],
            ideal, f"{fsdp['whole']:.0f} vs {hf_load['whole']:.0f} MB"),
        row(f"HF import, FSDP {n}: reading the folder, peak per rank / model size", fsdp["read"] / sizes["model"],
            ideal, f"{fsdp['read']:.0f} MB above the baseline, the rank's materialized shards included"),
        row(f"HF import, FSDP {n}: peak per rank without the mapped file pages / model size",
            fsdp["anon"] / sizes["model"], ideal,
            f"{fsdp['anon']:.0f} MB: anonymous RSS, the pages of the shard file being read left out"),
    ]  # fmt: skip
    for r in rows:
        print(f"{r['name']}: {r['ratio']:.2f} (ideal {r['ideal']}) {r['note']}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
