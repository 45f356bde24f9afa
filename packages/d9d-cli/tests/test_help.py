"""`--help` on every command, `--version`, and a lazy command group: `d9d --help` imports no command."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from d9d.cli import cli
from d9d.cli._table import COMMANDS, OPTIONS, group_help

COMMAND_NAMES = ["init", "plan", "preflight", "train", "checkpoints", "metrics", "export", "generate", "data"]

# Runs main() as the console script does and prints what it imported (as JSON, on stderr).
_IMPORTS = """
import json, sys
from d9d.cli import main
sys.argv = ["d9d", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
loaded = sorted(m for m in sys.modules if m in ("click", "torch", "importlib.metadata")
                or m.startswith(("click.", "torch.", "d9d.")))
print(json.dumps(loaded), file=sys.stderr)
"""


def _imports_of(*args: str) -> tuple[str, set[str]]:
    """(stdout, modules imported) of `d9d ARGS` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout, set(json.loads(out.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_every_command_has_help_with_examples(runner, command):
    result = runner.invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    assert f"d9d {command}" in result.output or f"-m d9d.cli {command}" in result.output


def _help_text(runner, command: str) -> str:
    """`d9d COMMAND --help` as one line of words (click wraps at the terminal's width)."""
    result = runner.invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_export_help_says_which_models_write_a_hugging_face_folder(runner):
    text = _help_text(runner, "export")
    assert "the Hugging Face backend write a folder transformers loads" in text
    assert "the model d9d ships (d9d.trainer.models: the quickstart, the `d9d init` templates" in text


def test_init_help_says_its_export_is_a_folder_transformers_loads(runner):
    text = _help_text(runner, "init")
    assert "the export is a Hugging Face folder transformers loads" in text
    assert "--template [quickstart|finetune]" in text and "--from PATH" in text


def test_group_help_lists_every_command(runner):
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    assert result.output == group_help()
    assert list(COMMANDS) == COMMAND_NAMES
    for command in COMMAND_NAMES:
        assert f"\n  {command} " in result.output


def test_the_help_table_matches_the_commands_and_options():
    """_table.py's table is what click itself would list: each command's short help, the group's options."""
    ctx = click.Context(cli, info_name="d9d")
    for name, text in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
        assert command.get_short_help_str(limit=200) == text
    records = [p.get_help_record(ctx) for p in cli.get_params(ctx)]
    assert dict(r for r in records if r is not None) == OPTIONS
    # click's own layout of the options and commands is exactly that part of `d9d --help`
    formatter = click.HelpFormatter(width=100)
    click.Group.format_options(cli, ctx, formatter)
    assert formatter.getvalue() == group_help()[group_help().index("Options:") :]


def test_unknown_command_suggests_the_closest(runner):
    result = runner.invoke(cli, ["trian"])
    assert result.exit_code == 2
    assert "No such command 'trian'; did you mean 'train'?" in result.stderr


def test_version_names_every_package(runner):
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    for name in ("d9d-mesh", "d9d-parallel", "d9d-data", "d9d-ckpt", "d9d-trainer", "d9d-cli"):
        assert name in result.output


def test_group_help_imports_neither_click_nor_any_command():
    stdout, loaded = _imports_of("--help")
    assert stdout == group_help()
    # no click, torch, command module or metadata
    assert loaded == {"d9d.cli", "d9d.cli.main", "d9d.cli._table"}, loaded


def test_command_help_imports_that_command_only():
    stdout, loaded = _imports_of("train", "--help")
    assert stdout.startswith("Usage: d9d train ")
    commands = {
        m for m in loaded if m.startswith("d9d.cli.commands.") and not m.rpartition(".")[2].startswith("_")
    }
    assert commands == {"d9d.cli.commands.train"}
    assert "torch" not in loaded and not any(m.startswith(("d9d.trainer", "d9d.mesh")) for m in loaded)


def test_group_help_through_click_imports_no_command():
    """`d9d --debug --help` goes through click (not the fast path) and still lists from the table."""
    stdout, loaded = _imports_of("--debug", "--help")
    assert stdout == group_help()
    assert "click" in loaded and not any(m.startswith("d9d.cli.commands.") for m in loaded)


def test_console_script_and_module_form_print_the_group_help():
    script = shutil.which("d9d", path=str(Path(sys.executable).parent))
    forms = [[sys.executable, "-m", "d9d.cli", "--help"], [sys.executable, "-m", "d9d.cli", "-h"]]
    if script is not None:
        forms.append([script, "--help"])
    for form in forms:
        out = subprocess.run(form, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == group_help()
