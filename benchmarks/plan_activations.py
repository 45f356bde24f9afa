"""`d9d plan`'s activation figure against the peak a real step holds saved for backward, per rank.

    OMP_NUM_THREADS=1 uv run python benchmarks/plan_activations.py

The tiny quickstart (2 layers, hidden 64, seq 32, 8 microbatches of 2) through `Trainer` on one
process, FSDP 2, TP 2, PP 2 (1F1B) and CP 2 (forked gloo ranks), in float32 and bfloat16, with
`trainer.activation_checkpointing.mode` none, full and op. Measured: the peak of the bytes autograd
holds saved for backward during the second optimizer step (`d9d.parallel.SavedActivations`: weights
and their compute copies left out; `d9d plan` counts those as `weight copies`). Planned: the
trainer's `plan_job` on each rank's planning context, for the CPU. The ratio is planned / measured,
per rank; the baseline is the measurement of the same job in the same run.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows  # noqa: E402
from _quickstart import TINY, planned_activations, run_forked, saved_activation_peaks  # noqa: E402

from d9d.mesh.testing import run_distributed  # noqa: E402

MESHES: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "FSDP 2": (2, ["mesh.data_parallel_shard=2"]),
    "TP 2": (2, ["mesh.tensor_parallel=2"]),
    "PP 2 (1F1B)": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
    "CP 2": (2, ["mesh.context_parallel=2"]),
}
DTYPES = ("float32", "bfloat16")
MODES = ("none", "full", "op")


def _variants(sets: list[str]) -> list[list[str]]:
    return [
        [*TINY, "mesh.data_parallel_shard=1", *sets, f"trainer.precision.param_dtype={dtype}",
         f"trainer.activation_checkpointing.mode={mode}", "trainer.schedule.total_steps=2",
         "trainer.checkpointing.period_steps=100"]
        for dtype in DTYPES for mode in MODES
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    parser.add_argument("--meshes", nargs="*", default=list(MESHES), help="a subset of: " + ", ".join(MESHES))
    args = parser.parse_args()
    rows = []
    print(f"{'mesh':<12} {'dtype':<9} {'AC':<5} {'rank':>4} {'planned':>10} {'measured':>10} {'ratio':>7}")
    for name in args.meshes:
        world, sets = MESHES[name]
        variants = _variants(sets)
        root = tempfile.mkdtemp()
        if world == 1:
            measured = [run_forked(saved_activation_peaks, root, variants)]
        else:
            measured = run_distributed(saved_activation_peaks, world, root, variants, timeout=600)
        planned = run_forked(planned_activations, variants, world)
        worst = 1.0
        for v, (dtype, mode) in enumerate((d, m) for d in DTYPES for m in MODES):
            for rank in range(world):
                plan, real = planned[v][rank], measured[rank][v]
                ratio = plan / real
                worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
                print(f"{name:<12} {dtype:<9} {mode:<5} {rank:>4} {plan:>10,} {real:>10,} {ratio:>7.4f}")
        rows.append(
            row(f"plan activations / measured, worst of 6 × {world} rank(s): {name}", worst, "1 (within 0.1)")
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
