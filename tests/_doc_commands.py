"""The shell commands a markdown page shows, and a runner that runs them as printed, in page order.

What counts as a command: every line of a ```bash / ```sh / ```shell block (a ```console block: its
`$ ` lines), continuation lines joined, comments dropped, except a `uv run ...` inside a comment
(`# or: uv run d9d train config.yaml`), which is a command too; and every inline `uv run ...` span
of the text. A block is not run when the last line before its fence is `<!-- not-run: REASON -->`;
its commands must exit with status N instead of 0 when that line is `<!-- exits: N REASON -->` (e.g.
`d9d plan` of a job that does not fit, shown on purpose). Single commands are left out by the test's
own table (`excluded`), each with its reason. A command line in any other code block (an indented one, a ```text one) fails the test: put it in a shell block.

How they run: in one copy of the repository's `examples/` per page (`copy_examples`), from the copy's
root, `cd` moving on for the rest of the page as in a shell. Each command runs in a process forked
from the test process, with its own working directory, argv, environment and output: `uv run python
SCRIPT` runs the script as `__main__`, `uv run d9d` the d9d command, `uv run torchrun` torchrun's
agent, whose workers are new interpreters as always. The test process imports torch and every d9d
package once (`warm_up`), so a command pays no interpreter start and no imports: on two cores a
2-step quickstart took 11 s as `python train.py`, 1.5-3 s forked. The one change: a training command
(a script given a `.yaml` config, or `d9d train`) gets `--set trainer.schedule.total_steps=2` appended
(4 when it sets total_steps itself: it asks to train on past the run before it).
"""

import functools
import importlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from d9d.mesh.testing import wait_for_child

ROOT = Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
STEPS = 2
#: For a command that sets total_steps itself: more than the STEPS a run before it trained.
CONTINUED_STEPS = 4
_STEPS_KEY = "trainer.schedule.total_steps"
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->$")
_EXITS = re.compile(r"^<!--\s*exits:\s*(\d+)\s+\S.*-->$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)")
#: A line that starts like a command, in a code block that is not a shell block.
_LOOKS_LIKE_COMMAND = re.compile(r"^\s*(\$ |(uv|d9d|torchrun|python|pip|cd) )")
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


@dataclass(frozen=True)
class Command:
    """One command as the page prints it (continuations joined, spaces collapsed)."""

    text: str
    page: str
    line: int
    not_run: str | None = None  # the reason of the block's `<!-- not-run: ... -->` marker
    exits: int = 0  # the exit status its block's `<!-- exits: N ... -->` marker expects

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Misplaced:
    """A command line in a code block that is not a shell block (so it would not be run)."""

    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text!r} is a command outside a shell block: put it in a ```bash block"


def page_commands(page: Path) -> tuple[list[Command], list[Misplaced]]:
    """The page's commands in reading order, and the command lines found outside shell blocks."""
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Command] = []
    misplaced: list[Misplaced] = []
    prose: list[tuple[int, str]] = []  # (line number, text) outside fenced blocks
    markers: dict[int, str] = {}  # line of each not-run marker -> its reason, until a block takes it
    statuses: dict[int, int] = {}  # line of each exits marker -> its status, until a block takes it
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            if m := _NOT_RUN.match(lines[i].strip()):
                markers[i + 1] = m.group(1)
            elif m := _EXITS.match(lines[i].strip()):
                statuses[i + 1] = int(m.group(1))
            elif lines[i].startswith("    ") and _LOOKS_LIKE_COMMAND.match(lines[i]):
                misplaced.append(Misplaced(name, i + 1, lines[i].strip()))  # an indented code block
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        language, marker, start = fence.group(3).lower(), fence.group(2), i + 1
        i += 1
        block: list[tuple[int, str]] = []
        while i < len(lines) and not lines[i].strip().startswith(marker):
            block.append((i + 1, lines[i]))
            i += 1
        i += 1  # the closing fence
        before = next((n for n, t in reversed(prose) if t.strip()), 0)
        reason = markers.pop(before, None) if language in SHELL_LANGUAGES else None
        status = statuses.pop(before, 0) if language in SHELL_LANGUAGES else 0
        if language in SHELL_LANGUAGES:
            found += [Command(text, name, n, reason, status) for n, text in _shell_commands(block, language)]
        else:
            misplaced += [Misplaced(name, n, t.strip()) for n, t in block if _LOOKS_LIKE_COMMAND.match(t)]
        prose.append((start, ""))  # a block ends the paragraph before it
    assert not markers, f"{name}: not-run markers not right before a shell block, lines {sorted(markers)}"
    assert not statuses, f"{name}: exits markers not right before a shell block, lines {sorted(statuses)}"
    found += [Command(text, name, n) for n, text in _inline_commands(prose)]
    found.sort(key=lambda c: c.line)
    return found, misplaced


def _shell_commands(block: list[tuple[int, str]], language: str) -> Iterator[tuple[int, str]]:
    """(line, command) of a shell block: continuations joined, comments dropped, `uv run` in comments kept."""
    pending: list[str] = []
    first = 0
    for n, raw in block:
        line = raw.rstrip()
        if language == "console" and not pending:
            if not line.lstrip().startswith("$ "):
                continue  # output, not a command
            line = line.lstrip()[2:]
        if not pending:
            first = n
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        code, comment = _split_comment(" ".join(pending))
        pending = []
        if code.strip():
            yield first, " ".join(code.split())
        alternative = re.search(r"\buv run \S.*", comment)
        if alternative:
            yield first, " ".join(alternative.group(0).rstrip(".").split())


def _split_comment(line: str) -> tuple[str, str]:
    """A shell line's code and its comment: `#` at the start or after a blank, outside quotes."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k], line[k + 1 :]
    return line, ""


def _inline_commands(prose: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Inline `uv run ...` spans of the text outside fenced blocks (a span may wrap a line)."""
    text = "\n".join(t for _, t in prose)
    numbers = [n for n, _ in prose]
    for match in re.finditer(r"`(uv run [^`]+)`", text):
        yield numbers[text.count("\n", 0, match.start())], " ".join(match.group(1).split())


# ---------------------------------------------------------------------------------------- running


def copy_examples(dest: Path) -> Path:
    """A copy of the repository's examples/ (without what runs left in the checkout) under dest."""
    shutil.copytree(ROOT / "examples", dest / "examples", ignore=shutil.ignore_patterns(
        "runs", "demo", "export*", "__pycache__", "*.png"))  # fmt: skip
    return dest


def left_behind(root: Path) -> list[str]:
    """The files the commands run in `root` wrote that a clone of the repository would show as new.

    A path of the copy stands for the same path in the checkout: a file the checkout tracks (the copied
    examples) or its `.gitignore` ignores (`runs/`, a prepared corpus, ...) is not counted.
    """
    written = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    listed = subprocess.run(["git", "ls-files", "-z", "examples"], cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, f"git ls-files in {ROOT}: {listed.stderr.strip()}"
    tracked = set(listed.stdout.split("\0"))
    new = [w for w in written if w not in tracked]
    checked = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-z"], cwd=ROOT,
                             input="\0".join(new), capture_output=True, text=True)  # fmt: skip
    assert checked.returncode in (0, 1), f"git check-ignore: {checked.stderr.strip()}"
    ignored = set(checked.stdout.split("\0"))
    return sorted(w for w in new if w not in ignored)


@dataclass
class Ran:
    """A command that ran: how long it took and what it printed."""

    command: Command
    argv: list[str]
    seconds: float
    output: str


class PageRunner:
    """Runs a page's commands in order from `root`; `cd` moves on like a shell's."""

    def __init__(self, root: Path, excluded: Mapping[tuple[str, str], str], timeout: float = 300) -> None:
        self.root = root.resolve()
        self.cwd = self.root
        self.excluded = excluded
        self.timeout = timeout
        self.ran: list[Ran] = []

    def run_page(self, commands: list[Command]) -> None:
        """Run every command that is not excluded; the first failure raises, naming page and line."""
        for command in commands:
            if command.not_run is None and (command.page, command.text) not in self.excluded:
                self.run(command)

    def run(self, command: Command) -> Ran:
        words = shlex.split(command.text)
        start = time.perf_counter()
        if words[0] == "cd" and len(words) == 2:
            target = (self.cwd / words[1]).resolve()
            assert target.is_dir() and target.is_relative_to(self.root), f"{command}: no directory {target}"
            self.cwd = target
            code, output, argv = 0, "", words
        elif words[:3] == ["uv", "run", "python"] and len(words) > 3 and not words[3].startswith("-"):
            argv = [words[3], *_with_steps(words[4:])]
            code, output = _forked(self.cwd, self.timeout, _run_script, argv)
        elif words[:3] == ["uv", "run", "d9d"]:
            argv = _with_steps(words[3:]) if words[3:4] == ["train"] else words[3:]
            code, output = _forked(self.cwd, self.timeout, _run_cli, argv)
        elif words[:3] == ["uv", "run", "torchrun"]:
            argv = _with_steps(words[3:])
            code, output = _forked(self.cwd, self.timeout, _run_torchrun, argv)
        else:
            raise AssertionError(
                f"{command}: this test runs `cd DIR`, `uv run python SCRIPT`, `uv run d9d` and "
                "`uv run torchrun` commands; mark this one not run (with its reason) or teach "
                "tests/_doc_commands.py to run it"
            )
        ran = Ran(command, argv, time.perf_counter() - start, output)
        assert code == command.exits, (
            f"{command}\nexit status {code}, not {command.exits} (ran {argv} in {self.cwd}):\n{output[-4000:]}"
        )
        self.ran.append(ran)
        return ran


def _with_steps(args: list[str]) -> list[str]:
    """A training command's arguments with the small step count appended (others unchanged)."""
    trains = any(a.endswith((".yaml", ".yml")) for a in args)
    if not trains:
        return args
    sets_steps = any(a.removeprefix("--set=").startswith(_STEPS_KEY + "=") for a in args)
    return [*args, "--set", f"{_STEPS_KEY}={CONTINUED_STEPS if sets_steps else STEPS}"]


@functools.cache
def warm_up() -> None:
    """Import, in this process, what the commands import: every public name of the d9d packages (the
    optional Hugging Face backend too, when transformers is installed) and dynamo, which a device
    mesh pulls in; once per process, before the first fork."""
    packages = ["d9d.mesh", "d9d.ckpt", "d9d.data", "d9d.parallel", "d9d.trainer", "d9d.cli"]
    if importlib.util.find_spec("transformers") is not None:
        packages.append("d9d.trainer.hf")
    for name in packages:
        package = importlib.import_module(name)
        for public in package.__all__:
            getattr(package, public)
    importlib.import_module("torch._dynamo")


def _run_script(argv: list[str]) -> None:
    """`python SCRIPT ARGS` in this (forked) process: its argv, its folder first on sys.path."""
    script = Path(argv[0]).resolve()
    for name, module in list(sys.modules.items()):  # what the parent imported from the checkout's examples
        file = getattr(module, "__file__", None) or ""
        if file.startswith(str(ROOT / "examples")):
            del sys.modules[name]
    sys.argv = list(argv)
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


def _run_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import main

    main(argv)


def _run_cli(argv: list[str]) -> None:
    from d9d.cli import cli

    cli.main(args=argv, prog_name="d9d")


def _forked(cwd: Path, timeout: float, fn: Callable[[list[str]], None], argv: list[str]) -> tuple[int, str]:
    """fn(argv) in a forked child with cwd, no torchrun variables and its output in a file: (status, output)."""
    with tempfile.TemporaryFile() as log:
        warm_up()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setsid()  # its own process group: a timeout kills it with whatever it started
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
                for name in _DIST_ENV:
                    os.environ.pop(name, None)
                os.environ["OMP_NUM_THREADS"] = "1"
                torch.set_num_threads(1)
                os.chdir(cwd)
                fn(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, int | None):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        code = wait_for_child(pid, timeout, group=True)
        log.seek(0)
        return code, log.read().decode(errors="replace")
