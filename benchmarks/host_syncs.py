"""Host syncs per training step: what an ordinary step (no log line, no checkpoint) waits for.

    OMP_NUM_THREADS=1 uv run python benchmarks/host_syncs.py

Counts `aten._local_scalar_dense` (every `.item()`, `float(t)`, `bool(t)`, `.tolist()`: a device
sync on CUDA) with a dispatch mode around `Trainer.train()`, on one process and FSDP 2 (forked gloo
ranks). Runs of 4 and 12 steps that log and save only at their last step differ by 8 ordinary
steps. With fused AdamW (what `optimizer.implementation: auto` picks on CUDA) the one left is the
non-finite check; foreach AdamW also reads its CPU step counters (not device syncs on CUDA).
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "packages" / "d9d-trainer" / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows  # noqa: E402
from _dispatch import OpRecorder  # noqa: E402
from _job import job_config  # noqa: E402

from d9d.mesh.testing import run_distributed  # noqa: E402
from d9d.trainer import Trainer  # noqa: E402


def _syncs(steps: int, mesh: dict | None, implementation: str, save_root: str) -> int:
    config = job_config(f"{save_root}/s{steps}", total_steps=steps, mesh=mesh)
    config["trainer"]["logging"]["period_steps"] = 1000
    config["trainer"]["checkpointing"]["period_steps"] = 0
    config["optimizer"]["implementation"] = implementation
    with Trainer.from_config(config) as trainer:
        recorder = OpRecorder()
        with recorder:
            trainer.train()
    return recorder.host_syncs


def per_step(mesh: dict | None, implementation: str, save_root: str) -> float:
    """Saves under save_root/s4 and save_root/s12: the same dirs on every rank."""
    return (_syncs(12, mesh, implementation, save_root) - _syncs(4, mesh, implementation, save_root)) / 8


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    rows = []
    print(f"{'mesh':<8} {'optimizer':<9} {'syncs per ordinary step':>24}")
    for name, mesh in (("local", None), ("FSDP 2", {"data_parallel_shard": 2})):
        for implementation in ("fused", "foreach"):
            root = tempfile.mkdtemp()
            if mesh is None:
                n = per_step(None, implementation, root)
            else:
                n = max(run_distributed(per_step, 2, mesh, implementation, root, timeout=300))
            print(f"{name:<8} {implementation:<9} {n:>24.1f}")
            if implementation == "fused":
                rows.append(
                    row(
                        f"host syncs per ordinary step ({name}, fused AdamW)",
                        n,
                        "<= 1",
                        "the non-finite check",
                    )
                )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
