"""Run every benchmark with modest sizes and print one table of ratios (measured vs ideal).

    uv run python benchmarks/run_all.py [--only hf_io async_ckpt ...] [--markdown] [--log-dir DIR]

Each benchmark runs in its own process (OMP_NUM_THREADS=1), prints its own detailed table, and
writes its ratios as JSON (`--json`); this script collects them. About 8 minutes on a 2-core
machine. The header records the machine and its load average before and after, since CPU timings
on a shared machine are noisy (±15%). A benchmark that fails is reported as FAILED in the table and
the script exits non-zero; the others still run.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, arguments): modest sizes so the whole run stays under ~10 minutes on 2 cores.
BENCHMARKS: list[tuple[str, list[str]]] = [
    ("trainer_overhead", ["--steps", "40", "--rounds", "2"]),
    ("parallel_memory", []),
    ("pipeline_schedules", ["--pp", "2", "--saved"]),
    ("ckpt_io", ["--mb", "400", "--shard-mb", "50"]),
    ("async_ckpt", ["--steps", "12", "--every", "3", "--rounds", "2"]),
    ("hf_io", ["--layers", "8", "--shard-mb", "100", "--repeats", "2"]),
    ("hf_backend", ["--steps", "30", "--rounds", "2", "--ranks", "2"]),
    ("data_loading", ["--samples", "10000"]),
    ("data_order", ["--old-samples", "2e7"]),
    ("data_prepare", ["--mb", "20", "--loader-tokens", "1e8", "--loader-steps", "50"]),
    ("cli_startup", ["--repeats", "10"]),
    ("init_time", ["--hidden", "1024", "--layers", "8"]),
    ("host_syncs", []),
    ("attention_backends", ["--steps", "10", "--seq", "256"]),
    ("grad_accumulation", []),
    ("context_parallel", ["--seq", "1024", "4096"]),
    ("cp_balance", ["--batches", "8"]),
    ("lora_memory", []),
    ("trackers", ["--steps", "61", "--rounds", "2"]),
    ("moe", ["--repeats", "3"]),
    ("float8", ["--steps", "10", "--fsdp"]),
    ("optimizer_states", ["--steps", "200", "--repeats", "10"]),
    ("cpu_offload", ["--steps", "12", "--rounds", "2"]),
    ("fused_loss", ["--tokens", "1024", "--hidden", "512", "--chunk", "128", "--repeats", "2"]),
    ("weight_casts", []),
    ("plan_activations", []),
    ("activation_checkpointing", ["--repeats", "5"]),
]


def _machine() -> list[str]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as fh:
        total_kb = int(fh.readline().split()[1])
    return [
        f"CPU: {cpu}, {os.cpu_count()} cores (nproc), {total_kb / 2**20:.1f} GiB RAM",
        f"Python {platform.python_version()}, torch {importlib.metadata.version('torch')}, "
        f"transformers {_version('transformers')}, {platform.platform()}",
    ]


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1/5/15 min)"


def _run(name: str, extra: list[str], log_dir: Path | None, timeout: int) -> tuple[list[dict], float, str]:  # type: ignore[type-arg]
    """The benchmark's rows, its wall seconds, and an error ('' when it succeeded)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "rows.json"
        command = [sys.executable, str(HERE / f"{name}.py"), *extra, "--json", str(out_json)]
        print(f"\n=== {name}: {' '.join(command[1:-2])}", flush=True)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            stdout, output, rc = done.stdout, done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            stdout, output, rc = "", f"{exc.stdout!r}\n{exc.stderr!r}\ntimed out after {timeout} s", -1
        seconds = time.perf_counter() - start
        print(stdout if rc == 0 else output[-4000:], end="", flush=True)
        if log_dir is not None:
            (log_dir / f"{name}.log").write_text(output)
        print(f"--- {name}: {seconds:.0f} s, {_load()}", flush=True)
        if rc != 0 or not out_json.exists():
            return [], seconds, f"rc={rc}"
        return json.loads(out_json.read_text()), seconds, ""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=[name for name, _ in BENCHMARKS])
    parser.add_argument("--markdown", action="store_true", help="print the final table as Markdown")
    parser.add_argument(
        "--log-dir", type=Path, help="keep each benchmark's full output and results.json (the table) here"
    )
    parser.add_argument("--timeout", type=int, default=400, help="seconds per benchmark")
    args = parser.parse_args()
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    header = [time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), *_machine(), f"before: {_load()}"]
    print("\n".join(header), flush=True)
    table: list[tuple[str, str, str, str, str]] = []
    failed = []
    total = time.perf_counter()
    for name, extra in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        rows, _seconds, error = _run(name, extra, args.log_dir, args.timeout)
        if error:
            failed.append(name)
            table.append((name, "FAILED", "", "", error))
        for r in rows:
            table.append((name, r["name"], f"{r['ratio']:.2f}", r["ideal"], r["note"]))
    total_s = time.perf_counter() - total
    print(f"\nall benchmarks: {total_s / 60:.1f} min; after: {_load()}")
    titles = ("benchmark", "ratio", "measured", "ideal / target", "note")
    if args.markdown:
        print("| " + " | ".join(titles) + " |")
        print("|" + "---|" * len(titles))
        for line in table:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(titles, *table, strict=False)]
        for line in (titles, *table):
            print("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    if args.log_dir is not None:
        document = {"header": header, "after": _load(), "minutes": total_s / 60, "rows": table}
        (args.log_dir / "results.json").write_text(json.dumps(document, indent=1))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
