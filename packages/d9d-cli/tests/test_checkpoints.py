"""`d9d checkpoints`: the table of committed checkpoints and the flags for everything else."""

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli

from d9d.ckpt import read_checkpoint_info
from d9d.cli import cli
from d9d.cli.commands._text import format_size
from d9d.cli.commands.checkpoints import format_time


def _row(output: str, step: int) -> str:
    return next(line for line in output.splitlines() if line.split() and line.split()[0] == str(step))


def test_lists_every_committed_checkpoint(runner, tiny_run):
    result = runner.invoke(cli, ["checkpoints", str(tiny_run.run_dir)])
    assert result.exit_code == 0, result.output
    for step in (2, 4):
        meta = read_checkpoint_info(tiny_run.run_dir / f"save-{step}").meta
        row = _row(result.output, step)
        assert format_time(meta.created_at) in row
        assert format_size(sum(meta.files.values())) in row
        assert row.endswith("all 1  ok")
    assert "not checkpoints" not in result.output


@pytest.fixture
def messy_run(tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    (run / "save-6").mkdir()  # a save whose commit marker was never written
    (run / ".save-8.tmp-0a1b2c3d").mkdir()
    (run / ".trash-save-0-0a1b2c3d").mkdir()
    meta = json.loads((run / "save-4" / "commit.json").read_text())
    victim = sorted(meta["files"])[0]
    (run / "save-4" / victim).write_bytes(b"")  # damaged after it was committed
    return run


def test_flags_incomplete_leftover_and_damaged(runner, messy_run):
    result = runner.invoke(cli, ["checkpoints", str(messy_run)])
    assert result.exit_code == 0, result.output
    assert _row(result.output, 2).endswith("ok")
    assert "damaged: 1 file resized" in _row(result.output, 4)
    lines = result.output.splitlines()
    flagged = lines[lines.index("not checkpoints:") + 1 :]
    assert [line.split()[0] for line in flagged] == [
        ".save-8.tmp-0a1b2c3d/",
        ".trash-save-0-0a1b2c3d/",
        "save-6/",
    ]
    assert "incomplete" in flagged[2]
    assert not any(line.split()[0] == "6" for line in lines if line.split())


def test_run_without_checkpoints(runner, tmp_path):
    (tmp_path / "fresh").mkdir()
    result = runner.invoke(cli, ["checkpoints", str(tmp_path / "fresh")])
    assert result.exit_code == 0
    assert "no committed checkpoints" in result.output


@pytest.mark.parametrize("case", ["missing", "file", "checkpoint", "save_dir"])
def test_wrong_paths_are_one_line(runner, tiny_run, tmp_path, case):
    path = {
        "missing": tmp_path / "nope",
        "file": tiny_run.config,
        "checkpoint": tiny_run.run_dir / "save-2",
        "save_dir": tiny_run.run_dir.parent,
    }[case]
    result = runner.invoke(cli, ["checkpoints", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    if case == "save_dir":
        assert "holds the runs tiny" in lines[0]
    if case == "checkpoint":
        assert f"pass its run directory {tiny_run.run_dir}" in lines[0]


def test_checkpoints_in_a_subprocess(tiny_run, tmp_path):
    ok = run_cli("checkpoints", str(tiny_run.run_dir))
    assert ok.returncode == 0, ok.stderr
    assert _row(ok.stdout, 4).endswith("ok")
    bad = run_cli("checkpoints", str(tmp_path / "nope"))
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
