"""The `d9d` commands of the top-level README run as printed (from the repository root)."""

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from d9d.cli import cli

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = re.findall(r"`uv run (d9d [^`]+)`", (ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_shows_d9d_commands():
    assert any(c.startswith("d9d plan ") for c in COMMANDS) and "d9d --help" in COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_runs_as_printed(command, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output
