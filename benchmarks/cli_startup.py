"""Start-up time of `d9d --help` against `python -c pass` (the interpreter alone).

    uv run python benchmarks/cli_startup.py [--repeats 10]

`d9d --help` must not import torch (torch alone takes seconds), so its time should stay a small
multiple of a bare interpreter's. Each command runs in a fresh process; the median of the repeats
is reported, and `import torch` once for scale. Timings are noisy on a shared machine.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import row, write_rows


def _median_seconds(command: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", help="also write the ratios here (for run_all.py)")
    args = parser.parse_args()
    python = sys.executable
    bare = _median_seconds([python, "-c", "pass"], args.repeats)
    script = shutil.which("d9d", path=str(Path(python).parent)) or shutil.which("d9d")
    entry = [script] if script else [python, "-c", "from d9d.cli import main; main()"]
    cli = _median_seconds([*entry, "--help"], args.repeats)
    module = _median_seconds([python, "-m", "d9d.cli", "--help"], args.repeats)
    torch = _median_seconds([python, "-c", "import torch"], max(1, args.repeats // 5))
    print(f"python -c pass          {bare * 1000:8.1f} ms")
    print(f"d9d --help              {cli * 1000:8.1f} ms   ratio {cli / bare:5.2f}x")
    print(f"python -m d9d.cli --help{module * 1000:8.1f} ms   ratio {module / bare:5.2f}x")
    print(f"python -c 'import torch'{torch * 1000:8.1f} ms   ratio {torch / bare:5.2f}x  (for scale)")
    write_rows(
        args.json,
        [
            row(
                "d9d --help / python -c pass",
                cli / bare,
                "small: no torch import",
                f"{cli * 1000:.0f} vs {bare * 1000:.0f} ms; import torch is {torch / bare:.0f}x",
            )
        ],
    )


if __name__ == "__main__":
    main()
