"""The bad-input corpus: `cases.yaml` read into `Case`s, each written out as a job directory of its own.

A case is the tiny job in `base.yaml` changed by a patch, deleted keys, `--set` overrides, extra files
(a provider that raises on import, a file where a directory belongs), or a whole config text of its
own (invalid YAML, an empty file). `snapshot` records every path under a directory, so a test can
tell that a refused job wrote nothing.
"""

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BASE = HERE / "base.yaml"
CASES = HERE / "cases.yaml"
DRIVER = HERE / "_driver.py"
QUICKSTART_TRAIN = ROOT / "examples" / "quickstart" / "train.py"

Entry = Literal["cli", "script"]


class Case(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One malformed job and what its one error line must contain.

    Attributes:
        expect: fragments that must all appear in the error line: the key (or file) and the fix.
        patch: merged into the base config (mappings merge, anything else replaces).
        unset: dotted key paths removed from the base config.
        sets: `--set` overrides passed on the command line.
        text: the config file's whole text, instead of the base config.
        files: extra files written into the case directory (relative path: content; a path ending
            in "/" makes an empty directory).
        config: the CONFIG argument, relative to the case directory.
        importable: the case directory is on the import path (for `module:Name` providers).
        separate: also run this case in a process of its own, through this entry point (`d9d train`,
            or `python examples/quickstart/train.py` for `script`).
        entries: the entry points that must refuse it (the CLI, and `python train.py`).
        encoding: how the config text is written (e.g. latin-1: a file that is not UTF-8).
        xfail: the product fix this case waits for (it is expected to fail until then).
    """

    name: str
    expect: list[str]
    patch: dict[str, Any] = {}
    unset: list[str] = []
    sets: list[str] = []
    text: str | None = None
    files: dict[str, str] = {}
    config: str = "config.yaml"
    importable: bool = False
    separate: Entry | None = None
    entries: list[Entry] = msgspec.field(default_factory=lambda: ["cli", "script"])
    encoding: str = "utf-8"
    xfail: str | None = None


def load_cases(path: Path = CASES) -> list[Case]:
    """Every case of a corpus file; names are unique."""
    cases = msgspec.convert(yaml.safe_load(path.read_text(encoding="utf-8")), list[Case])
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), f"duplicate case names in {path}"
    return cases


def base_config() -> dict[str, Any]:
    """`base.yaml` with its provider files and dataset path made absolute (so it runs from anywhere)."""
    config = yaml.safe_load(BASE.read_text(encoding="utf-8"))
    for role, spec in config["providers"].items():
        target, _, name = spec.rpartition(":")
        if target.endswith(".py"):
            config["providers"][role] = f"{(HERE / target).resolve()}:{name}"
    config["dataset"]["path"] = str((HERE / config["dataset"]["path"]).resolve())
    return config


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` merged in (mappings merge recursively, other values replace)."""
    result = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def without(config: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """`config` with the dotted key paths removed."""
    result = copy.deepcopy(config)
    for path in paths:
        *parents, last = path.split(".")
        node = result
        for part in parents:
            node = node[part]
        del node[last]
    return result


def write_case(case: Case, directory: Path, base: dict[str, Any] | None = None) -> list[str]:
    """Write the case's config and files into `directory`; returns the `d9d train` arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    config = without(merge(base if base is not None else base_config(), case.patch), case.unset)
    text = case.text if case.text is not None else yaml.safe_dump(config, sort_keys=False)
    (directory / "config.yaml").write_text(text, encoding=case.encoding)
    for name, content in case.files.items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            target.mkdir(exist_ok=True)
        else:
            target.write_text(content, encoding="utf-8")
    return [case.config, *[arg for item in case.sets for arg in ("--set", item)]]


def snapshot(directory: Path) -> dict[str, str]:
    """Every path under `directory` with its kind, size and content hash (directories: kind only)."""
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames:
            found[os.path.relpath(os.path.join(dirpath, name), directory)] = "dir"
        for name in filenames:
            path = Path(dirpath, name)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            found[os.path.relpath(path, directory)] = f"file {path.stat().st_size} {digest}"
    return found


def judge(
    code: int | str | None,
    stderr: str,
    expect: Sequence[str],
    before: dict[str, str],
    after: dict[str, str],
) -> list[str]:
    """What a refused job did wrong against the standard (empty: nothing).

    The standard: a non-zero exit status (an escaped exception, `"raised"`, counts as wrong), exactly
    one `error: ` line on stderr holding every fragment of `expect`, no traceback, and the job
    directory unchanged (`before` and `after` are its `snapshot`s).
    """
    problems = []
    if code == "raised":
        problems.append("an exception escaped the entry point")
    elif code in (0, None):
        problems.append(f"exit status {code}, expected non-zero")
    lines = [line for line in stderr.splitlines() if line.strip()]
    if "Traceback" in stderr:
        problems.append("a traceback on stderr")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, expected exactly one")
    elif not lines[0].startswith("error: "):
        problems.append("the stderr line does not start with 'error: '")
    missing = [fragment for fragment in expect if fragment not in stderr]
    if missing:
        problems.append(f"the error does not mention {missing}")
    changed = sorted(set(before) ^ set(after)) + sorted(
        k for k in before if k in after and after[k] != before[k]
    )
    if changed:
        problems.append(f"the job directory changed: {changed}")
    return problems


def describe(result: dict[str, Any]) -> str:
    """A failed case's output, for the assertion message."""
    return json.dumps({k: (v[-3000:] if isinstance(v, str) else v) for k, v in result.items()}, indent=1)


def clean_env(pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """This environment without a launcher's variables (a plain one-process job), one thread per op."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def command(entry: Entry, argv: Sequence[str]) -> list[str]:
    """A process of its own: the `d9d` console script (`d9d train ...`), or `python train.py ...`."""
    if entry == "script":
        return [sys.executable, str(QUICKSTART_TRAIN), *argv]
    script = Path(sys.executable).with_name("d9d")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "d9d.cli"]
    return [*head, "train", *argv]


def run_driver(manifest: list[dict[str, Any]], workdir: Path, timeout: float = 240) -> dict[str, Any]:
    """Run every manifest item in one `_driver.py` process; its results by item id."""
    manifest_path, results_path = workdir / "manifest.json", workdir / "results.json"
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(manifest_path), str(results_path)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the driver itself failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results: dict[str, Any] = json.loads(results_path.read_text(encoding="utf-8"))
    return results


def run_concurrently(
    jobs: dict[str, tuple[list[str], Path, dict[str, str]]], timeout: float = 240
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Start every (command, cwd, env) at once and wait for all: separate processes, overlapping."""
    procs = {
        name: subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, (cmd, cwd, env) in jobs.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def copy_tree(source: Path, target: Path) -> None:
    """A byte-for-byte copy of a directory tree."""
    shutil.copytree(source, target, symlinks=True)
