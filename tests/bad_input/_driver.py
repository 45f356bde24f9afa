"""Run many `d9d train` (or `python train.py`) invocations in one interpreter, one after another.

    python _driver.py MANIFEST.json RESULTS.json

MANIFEST is a list of {"id", "entry": "cli" | "script", "cwd", "argv", "pythonpath"}. Each invocation
runs in its `cwd` (with the `pythonpath` directories importable) with file descriptors 1 and 2 redirected to files of its own, so everything it prints (click,
logging handlers, warnings, C code) is captured; a SystemExit gives its exit status, any other
exception is printed as a traceback and recorded as status "raised". Importing torch once for all
cases keeps a corpus of dozens of real processes' worth of checks to a few seconds.
"""

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def _invoke(entry: str, argv: list[str]) -> int | str:
    if entry == "cli":
        from d9d.cli import main

        sys.argv = ["d9d", "train", *argv]
        main()
    else:
        from d9d.trainer import main as script_main

        sys.argv = ["train.py", *argv]
        script_main(argv)
    return 0


def _run(entry: str, argv: list[str], cwd: str) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        start = time.perf_counter()
        code: int | str
        try:
            os.chdir(cwd)
            code = _invoke(entry, argv)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except Exception:
            traceback.print_exc()
            code = "raised"
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        return {
            "code": code,
            "stdout": out.read().decode("utf-8", "replace"),
            "stderr": err.read().decode("utf-8", "replace"),
            "seconds": round(seconds, 3),
        }


def main() -> None:
    manifest_path, results_path = (Path(arg).resolve() for arg in sys.argv[1:3])
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    results = {}
    for item in manifest:
        sys.path[:0] = item.get("pythonpath", [])
        results[item["id"]] = _run(item["entry"], item["argv"], item["cwd"])
    results_path.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
