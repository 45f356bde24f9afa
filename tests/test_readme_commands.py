"""The commands of the top-level README run as printed, in the order a reader meets them.

In a temporary copy of `examples/`, with a small step count added to the training commands (the only
change): the quickstart trains (one process; the torchrun form is the e2e tests'), then every
`uv run d9d ...` command runs there, `d9d metrics` on the run the quickstart just wrote. `uv sync`
and `uv run pytest` are this very environment and this very suite, so they are not rerun.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from d9d.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: Every `uv run ...` the README shows, in order: code blocks and inline code alike.
COMMANDS = [
    " ".join(c.replace("\\\n", " ").split())
    for c in re.findall(r"(?:^|`)(uv run (?:\\\n|[^`#\n])+)", README, flags=re.M)
]
FEW_STEPS = ["trainer.schedule.total_steps=2", "trainer.checkpointing.period_steps=2"]


def test_the_readme_shows_the_commands_this_test_runs():
    kinds = [shlex.split(c)[2] for c in COMMANDS]
    assert kinds.count("python") == 1 and "d9d" in kinds and "pytest" in kinds, COMMANDS


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A copy of examples/ where the README's quickstart command has trained (2 steps)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(
        ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("runs", "demo", "export")
    )
    (command,) = [c for c in COMMANDS if shlex.split(c)[2] == "python"]
    args = shlex.split(command)[3:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, *args, *FEW_STEPS], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.parametrize("command", [c for c in COMMANDS if shlex.split(c)[2] == "d9d"])
def test_a_readme_d9d_command_runs_as_printed(command, copy, monkeypatch):
    monkeypatch.chdir(copy)
    result = CliRunner().invoke(cli, shlex.split(command)[3:])
    assert result.exit_code == 0, result.output
