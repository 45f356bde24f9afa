"""Wall time of the `d9d` commands that need no model, against `python -c pass` (the interpreter alone).

    uv run python benchmarks/cli_startup.py [--repeats 10] [--compare-src OLD_TREE]

Help, listing and verifying a run's checkpoints, a config error from `d9d plan` / `d9d train` (an
unknown key, a mesh whose product is not the launch's), and restarting a finished run must not import
torch (torch alone takes seconds), so each should stay a small multiple of a bare interpreter's
start-up. Before timing, a tiny quickstart (`d9d init`, two steps of `d9d train`) is trained once in a
temp dir; its config and run directory are what the commands read. Each command runs in a fresh
process; the median of the repeats is reported, with whether that command imported torch, and
`import torch` once for scale.

`--compare-src` times the same commands on another checkout's sources as well (its `packages/*/src`
put first on PYTHONPATH, e.g. `git archive <commit> packages | tar -x -C OLD_TREE`; median of
`--compare-repeats`), in the same run and against the same `python -c pass`: before / after ratios
on a noisy machine. Timings are noisy
on a shared machine; read ratios, not milliseconds.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import row, write_rows

#: The quickstart made tiny: the run only has to exist (its checkpoints are what the commands read).
_TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "dataset.seq_len=32",
    "data.global_batch_size=4",
    "data.microbatch_size=2",
    "trainer.schedule.total_steps=2",
    "trainer.checkpointing.period_steps=1",
    "trainer.logging.progress_bar=false",
]

# Runs a command as the console script does, then prints on stderr whether it imported torch.
_PROBE = """
import sys
sys.argv = ["d9d", *sys.argv[1:]]
try:
    from d9d.cli import main
    main()
except SystemExit:
    pass
print("D9D_TORCH", "torch" in sys.modules, file=sys.stderr)
"""


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _env(src: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if src is not None:  # that checkout's packages shadow the installed (editable) ones
        paths = [str(p) for p in sorted((src / "packages").glob("*/src"))]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _median_seconds(command: list[str], repeats: int, env: dict[str, str], cwd: Path) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _imports_torch(args: list[str], env: dict[str, str], cwd: Path) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    line = next(line for line in out.stderr.splitlines() if line.startswith("D9D_TORCH"))
    return line.split()[1] == "True"


def _train_tiny_run(work: Path, entry: list[str]) -> tuple[Path, Path]:
    """A quickstart trained for two steps in `work`: (its config, its run directory)."""
    env = _env(None)
    subprocess.run([*entry, "init", "job"], cwd=work, env=env, check=True, capture_output=True)
    config = work / "job" / "config.yaml"
    trained = subprocess.run(
        [*entry, "train", str(config), *_sets(_TINY)], cwd=work, env=env, capture_output=True
    )
    if trained.returncode != 0:
        raise SystemExit(f"training the tiny run failed:\n{trained.stderr.decode()[-3000:]}")
    return config, work / "job" / "runs" / "quickstart"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compare-src", type=Path, help="a checkout whose packages/*/src to time too")
    parser.add_argument("--compare-repeats", type=int, default=3, help="repeats on --compare-src (slow)")
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    python = sys.executable
    script = shutil.which("d9d", path=str(Path(python).parent)) or shutil.which("d9d")
    entry = [script] if script else [python, "-c", "from d9d.cli import main; main()"]
    with tempfile.TemporaryDirectory(prefix="d9d-cli-startup-") as tmp:
        work = Path(tmp)
        config, run_dir = _train_tiny_run(work, entry)
        cases: list[tuple[str, list[str]]] = [
            ("d9d --help", ["--help"]),
            ("d9d plan --help", ["plan", "--help"]),
            ("d9d checkpoints RUN", ["checkpoints", str(run_dir)]),
            ("d9d checkpoints --verify RUN", ["checkpoints", "--verify", str(run_dir)]),
            ("d9d plan: unknown key", ["plan", str(config), *_sets([*_TINY, "trainer.bogus=1"])]),
            ("d9d plan: mesh product", ["plan", str(config), "--world-size", "3", *_sets(_TINY)]),
            ("d9d train: unknown key", ["train", str(config), *_sets([*_TINY, "trainer.bogus=1"])]),
            (
                "d9d train: mesh product",
                ["train", str(config), *_sets([*_TINY, "mesh.data_parallel_shard=2"])],
            ),
            ("d9d train: finished run", ["train", str(config), *_sets(_TINY)]),
        ]
        trees: list[tuple[str, Path | None, int]] = [("now", None, args.repeats)]
        if args.compare_src is not None:
            trees.insert(0, ("before", args.compare_src.resolve(), args.compare_repeats))
        bare = _median_seconds([python, "-c", "pass"], args.repeats, _env(None), work)
        module = _median_seconds([python, "-m", "d9d.cli", "--help"], args.repeats, _env(None), work)
        torch = _median_seconds([python, "-c", "import torch"], max(1, args.repeats // 5), _env(None), work)
        measured: dict[str, dict[str, tuple[float, bool]]] = {name: {} for name, _ in cases}
        for tree, src, repeats in trees:
            env = _env(src)
            for name, case in cases:
                seconds = _median_seconds([*entry, *case], repeats, env, work)
                measured[name][tree] = (seconds, _imports_torch(case, env, work))
    print(f"{'python -c pass':34} {bare * 1000:8.1f} ms")
    print(f"{'python -m d9d.cli --help':34} {module * 1000:8.1f} ms   ratio {module / bare:6.2f}x")
    rows = []
    for name, by_tree in measured.items():
        cells = []
        for tree, (seconds, torch_imported) in by_tree.items():
            mark = "imports torch" if torch_imported else "no torch"
            cells.append(f"{tree}: {seconds * 1000:7.1f} ms {seconds / bare:6.2f}x ({mark})")
        print(f"{name:34} " + "   ".join(cells))
        now, now_torch = by_tree["now"]
        note = f"{now * 1000:.0f} vs {bare * 1000:.0f} ms; {'imports torch' if now_torch else 'no torch'}"
        if "before" in by_tree:
            note += f"; before {by_tree['before'][0] / bare:.1f}x"
        rows.append(row(f"{name} / python -c pass", now / bare, "small: no torch import", note))
    print(f"{'python -c import torch':34} {torch * 1000:8.1f} ms   ratio {torch / bare:6.2f}x  (for scale)")
    write_rows(args.json, rows)
    print(json.dumps({"load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
