"""`--help` on every command, `--version`, and a `d9d --help` that never imports torch."""

import subprocess
import sys

import pytest

from d9d.cli import cli

COMMANDS = ["init", "plan", "train", "checkpoints", "metrics", "export"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(runner, command):
    result = runner.invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output
    assert f"d9d {command}" in result.output or f"-m d9d.cli {command}" in result.output


def test_group_help_lists_every_command(runner):
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


def test_version_names_every_package(runner):
    result = runner.invoke(cli, ["--version"])
    assert result.exit_code == 0
    for name in ("d9d-mesh", "d9d-parallel", "d9d-data", "d9d-ckpt", "d9d-trainer", "d9d-cli"):
        assert name in result.output


def test_help_in_a_subprocess_does_not_import_torch():
    code = (
        "import sys\n"
        "from d9d.cli import main\n"
        "sys.argv = ['d9d', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'd9d.trainer', 'd9d.mesh')))\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    assert "Commands:" in out.stdout


def test_module_form_prints_help():
    out = subprocess.run(
        [sys.executable, "-m", "d9d.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "Usage: " in out.stdout and "plan" in out.stdout
