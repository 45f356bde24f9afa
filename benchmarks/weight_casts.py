"""Parameter casts per step: bf16 compute without FSDP mixed precision, before and after cast-once.

    OMP_NUM_THREADS=1 uv run python benchmarks/weight_casts.py

The quickstart (2 layers, bf16 on CPU) through `Trainer`, for one process (1 and 4 microbatches, with
and without full activation checkpointing), the MoE quickstart, DDP 2, TP 2 and PP 2 (forked gloo
ranks, 4 microbatches). A dispatch mode (`tests/_dispatch.py`, `ParamCasts`) counts the copies that
change a parameter's dtype and the bytes they write; runs of 1 and 3 steps differ by 2 ordinary
steps (the pipeline schedule's first-step shape inference drops out). "before" is the same job on
the path before (`tests/_quickstart.py`, `train_counting_casts(today=True)`: the step's
`weights_cast_once` scope off, DDP resharding after every backward), in the same run. Also the
bytes `d9d plan` counts for the copies a step keeps (`weight copies`) beside the bytes cast in one
step, on one process.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import row, write_rows  # noqa: E402
from _quickstart import CONFIG, MOE, TINY, run_forked, train_counting_casts  # noqa: E402

from d9d.mesh.testing import run_distributed  # noqa: E402

CASES: list[tuple[str, int, list[str]]] = [
    ("1 process, 1 mb", 1, ["data.global_batch_size=2"]),
    ("1 process, 4 mb", 1, ["data.global_batch_size=8"]),
    ("1 process, 4 mb, full AC", 1, ["data.global_batch_size=8", "trainer.activation_checkpointing.mode=full"]),
    ("MoE, 4 mb, full AC", 1, ["data.global_batch_size=8", "trainer.activation_checkpointing.mode=full", *MOE]),
    ("DDP 2, 4 mb", 2, ["mesh.data_parallel_replicate=2", "data.global_batch_size=16"]),
    ("TP 2, 4 mb, full AC", 2, ["mesh.tensor_parallel=2", "data.global_batch_size=8",
                                "trainer.activation_checkpointing.mode=full"]),
    ("PP 2, 4 mb", 2, ["mesh.pipeline_parallel=2", "data.global_batch_size=8"]),
]  # fmt: skip


def _casts(ranks: int, sets: list[str], today: bool, steps: int) -> list[tuple[int, int]]:
    """Per rank: (casts, bytes cast) over a run of `steps` steps."""
    root = tempfile.mkdtemp()
    args = [*sets, f"trainer.schedule.total_steps={steps}"]
    runs = (
        [run_forked(train_counting_casts, root, args, today)]
        if ranks == 1
        else run_distributed(train_counting_casts, ranks, root, args, today, timeout=300)
    )
    return [(sum(run["counts"].values()), run["bytes"]) for run in runs]


def per_step(ranks: int, sets: list[str], today: bool) -> list[tuple[float, float]]:
    """Per rank: (casts, bytes) of one ordinary step, from runs of 1 and 3 steps."""
    one, three = _casts(ranks, sets, today, 1), _casts(ranks, sets, today, 3)
    return [((c3 - c1) / 2, (b3 - b1) / 2) for (c1, b1), (c3, b3) in zip(one, three, strict=True)]


def _planned(sets: list[str]) -> int:
    from d9d.trainer import load_job_config
    from d9d.trainer.planning import plan_config

    loaded = load_job_config(CONFIG, [*TINY, "trainer.precision.param_dtype=bfloat16", *sets])
    memory = plan_config(loaded, device="cpu").memory
    assert memory is not None
    return memory.weight_copies


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    rows = []
    print(
        f"{'case':<26} {'rank':>4} {'casts before':>12} {'casts now':>9} {'bytes before':>12} {'bytes now':>10}"
    )
    for name, ranks, sets in CASES:
        before, now = per_step(ranks, sets, True), per_step(ranks, sets, False)
        for rank, ((cb, bb), (cn, bn)) in enumerate(zip(before, now, strict=True)):
            print(f"{name:<26} {rank:>4} {cb:>12.0f} {cn:>9.0f} {bb:>12,.0f} {bn:>10,.0f}")
        casts_before, casts_now = before[0][0], now[0][0]
        rows.append(row(f"weight casts per step, now / before: {name}", casts_now / casts_before,
                        "1 / (microbatches × (1 + recompute))", f"rank 0: {casts_now:.0f} vs {casts_before:.0f}"))  # fmt: skip
    planned = run_forked(_planned, ["data.global_batch_size=8"])
    cast = per_step(1, ["data.global_batch_size=8"], False)[0][1]
    print(f"d9d plan's weight copies {planned:,} bytes; cast in one step {cast:,.0f} bytes")
    rows.append(row("weight copies, d9d plan / cast in one step (1 process)", planned / cast, "1"))
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
