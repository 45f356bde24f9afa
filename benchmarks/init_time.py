"""Model initialization time: d9d's mesh-independent init on the job's device vs on the CPU (the old
path) vs a plain `to_empty` + `init_weights()`.

    uv run python benchmarks/init_time.py [--hidden 2048 --layers 16]   # ≈ 1 B parameters
    uv run python benchmarks/init_time.py --device cuda                  # on a GPU: the real gain

d9d initializes each module on an unsharded copy seeded by its path, so every mesh starts from the
same weights. Where that copy lives decides the speed: on the job's device (`trainer.determinism.
init_device: auto`, the default) or on the CPU (`init_device: cpu`, the old behaviour). On a CPU-only
machine both are the CPU, so the first ratio is 1 by construction; a GPU shows the difference.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows  # noqa: E402

from d9d.trainer import materialize_and_initialize  # noqa: E402
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig  # noqa: E402


def _build(config: ReferenceModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return ReferenceForCausalLM(config)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    config = ReferenceModelConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_layers=args.layers, num_attention_heads=max(1, args.hidden // 128), qk_norm=False,
    )  # fmt: skip
    times = {}
    for name, init_device in (("d9d, on the job's device", device), ("d9d, on the CPU (old path)", "cpu")):
        model = _build(config)
        start = time.perf_counter()
        materialize_and_initialize(model, device, 0, init_device=init_device)
        _sync(device)
        times[name] = time.perf_counter() - start
        n = sum(p.numel() for p in model.parameters())
        del model
    model = _build(config)
    start = time.perf_counter()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    _sync(device)
    times["plain to_empty + init_weights"] = time.perf_counter() - start
    print(
        f"# {n / 1e9:.2f} B parameters on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU, 1 thread'})"
    )
    for name, seconds in times.items():
        print(f"{name:<32} {seconds:8.2f} s")
    new, old, plain = times.values()
    print(f"on device / on CPU: {new / old:.3f}; d9d on device / plain: {new / plain:.3f}")
    note = f"{n / 1e9:.2f} B params on {device}: {new:.1f} s vs {old:.1f} s (CPU) vs {plain:.1f} s (plain)"
    write_rows(args.json, [row("init: on the job's device / on the CPU", new / old, "< 1 on a GPU", note),
                           row("init: d9d (mesh-independent) / plain init_weights", new / plain, "1", note)])  # fmt: skip


if __name__ == "__main__":
    main()
