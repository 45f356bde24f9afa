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


def test_damage_counts_missing_and_resized_files(runner, messy_run):
    meta = json.loads((messy_run / "save-2" / "commit.json").read_text())
    first, second, third = sorted(meta["files"])[:3]
    (messy_run / "save-2" / first).unlink()
    (messy_run / "save-2" / second).write_bytes(b"")
    with open(messy_run / "save-2" / third, "ab") as f:
        f.write(b"longer")
    (messy_run / ".save-3.tmp-zzz").mkdir()  # not a name d9d-ckpt gives: not flagged as its leftover
    result = runner.invoke(cli, ["checkpoints", str(messy_run)])
    assert result.exit_code == 0, result.output
    assert _row(result.output, 2).endswith("damaged: 1 file missing, 2 files resized")
    assert ".save-3.tmp-zzz" not in result.output


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


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_reports_each_checkpoint_and_fails_on_a_flipped_byte(runner, tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    ok = runner.invoke(cli, ["checkpoints", "--verify", str(run)])
    assert ok.exit_code == 0, ok.output
    assert _row(ok.output, 2).endswith("ok") and _row(ok.output, 4).endswith("ok")
    assert "verified 2 checkpoint(s): 0 damaged" in ok.output
    shard = max((run / "save-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(shard)
    plain = runner.invoke(cli, ["checkpoints", str(run)])
    assert plain.exit_code == 0 and _row(plain.output, 4).endswith("ok")  # sizes alone cannot tell
    bad = runner.invoke(cli, ["checkpoints", "--verify", str(run)])
    assert bad.exit_code == 1, bad.output
    assert _row(bad.output, 2).endswith("ok") and _row(bad.output, 4).endswith("damaged")
    lines = bad.output.splitlines()
    at = lines.index("save-4 is damaged:")
    assert lines[at + 1 : at + 3] == [
        f"  save-4/{shard.name} is damaged (checksum mismatch)",
        "  move save-4 aside to resume from save-2",
    ]
    assert "verified 2 checkpoint(s): 1 damaged" in bad.output


def test_verify_of_a_checkpoint_without_checksums_says_so(runner, tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    commit = run / "save-2" / "commit.json"
    record = json.loads(commit.read_text())
    del record["checksums"]  # as written before d9d recorded checksums
    commit.write_text(json.dumps(record))
    result = runner.invoke(cli, ["checkpoints", "--verify", str(run)])
    assert result.exit_code == 0, result.output
    assert _row(result.output, 2).endswith("ok (no checksums: sizes only)")
    assert _row(result.output, 4).endswith("ok")


def test_verify_in_a_subprocess_exits_1_when_damaged(tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    _flip(run / "save-2" / "extra.msgpack")
    bad = run_cli("checkpoints", "--verify", str(run))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "save-2/extra.msgpack is damaged (checksum mismatch)" in bad.stdout
    assert "move save-2 aside to start the run afresh" in bad.stdout
