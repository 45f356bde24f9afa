"""`d9d export`: from a run directory (config stored in the checkpoint) or from the config file."""

import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli, write_job

from d9d.cli import cli
from d9d.cli.commands.export import find_config_dir, relative_provider_files
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _weights(directory: Path) -> dict:
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no safetensors in {directory}"
    out = {}
    for file in files:
        out.update(load_file(file))
    return out


def test_relative_provider_files_and_where_they_are_found(tmp_path):
    raw = {
        "providers": {"model": "train.py:M", "task": "d9d.trainer:CausalLMTask", "dataset": "/abs/x.py:D"},
        "trainer": {"checkpointing": {"save_dir": "out/runs"}},
    }
    assert relative_provider_files(raw) == ["train.py"]
    started = tmp_path / "proj"
    run_dir = started / "out" / "runs" / "r"
    run_dir.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    assert find_config_dir(raw, run_dir, tmp_path / "elsewhere")[0] is None
    (started / "sub").mkdir()
    (started / "sub" / "train.py").write_text("")
    assert find_config_dir(raw, run_dir, tmp_path / "elsewhere")[0] == (started / "sub").resolve()
    (started / "train.py").write_text("")  # the directory the job was started from wins
    assert find_config_dir(raw, run_dir, tmp_path / "elsewhere")[0] == started.resolve()


def test_export_latest_and_given_step_from_the_run_dir(runner, tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics_before = (tiny_run.run_dir / METRICS_FILE).read_bytes()
    latest = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", "latest"])
    assert latest.exit_code == 0, latest.output
    assert re.search(r"d9d.cli: export finished +step=4 ", latest.output), latest.output
    older = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", "step2", "--step", "2"])
    assert older.exit_code == 0, older.output
    a, b = _weights(tmp_path / "latest"), _weights(tmp_path / "step2")
    assert sorted(a) == sorted(b) and "embed.weight" in a
    assert any(not (a[k] == b[k]).all() for k in a)  # two optimizer steps apart
    assert (tiny_run.run_dir / METRICS_FILE).read_bytes() == metrics_before  # export changes nothing


def test_export_from_the_config_matches_the_run_dir(runner, tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_dir = f"trainer.checkpointing.save_dir={tiny_run.run_dir.parent}"
    by_config = runner.invoke(
        cli, ["export", str(tiny_run.config), "--out", "c", "--step", "2", "--set", save_dir]
    )
    assert by_config.exit_code == 0, by_config.output
    by_run = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", "r", "--step", "2"])
    assert by_run.exit_code == 0, by_run.output
    a, b = _weights(tmp_path / "c"), _weights(tmp_path / "r")
    assert all((a[k] == b[k]).all() for k in a)


def test_stored_config_whose_providers_cannot_be_found(runner, tmp_path, monkeypatch):
    config = write_job(tmp_path / "job")
    save_dir = tmp_path / "runs"
    trained = runner.invoke(cli, ["train", str(config), "--set", f"trainer.checkpointing.save_dir={save_dir}",
                                  "--set", "trainer.schedule.total_steps=2"])  # fmt: skip
    assert trained.exit_code == 0, trained.output
    moved = tmp_path / "copy" / "tiny"
    shutil.copytree(save_dir / "tiny", moved)
    shutil.rmtree(tmp_path / "job")  # the config's directory (stored in the checkpoint) is gone
    shutil.rmtree(save_dir)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli, ["export", str(moved), "--out", "o"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert (
        "tiny_job.py relative to its original config file" in line
        and "d9d export path/to/config.yaml" in line
    )
    assert len(line.splitlines()) == 1


@pytest.mark.parametrize("case", ["missing-step", "out-is-a-file", "no-such-path", "no-checkpoints"])
def test_export_errors_are_one_line(runner, tiny_run, tmp_path, case):
    out = tmp_path / "out"
    args = ["export", str(tiny_run.run_dir), "--out", str(out)]
    if case == "missing-step":
        args += ["--step", "3"]
    elif case == "out-is-a-file":
        out.write_text("x")
    elif case == "no-such-path":
        args[1] = str(tmp_path / "nope")
    else:
        args[1] = str(tiny_run.config)
        args += ["--set", f"trainer.checkpointing.save_dir={tmp_path / 'empty'}"]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    if case == "missing-step":
        assert "[2, 4]" in lines[0]
    if case == "out-is-a-file":
        assert "is a file; pass a directory" in lines[0]


def _new_file_mode() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def test_exported_files_have_the_mode_of_checkpoint_files(runner, tiny_run, tmp_path):
    out = tmp_path / "o"
    result = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", str(out), "--step", "2"])
    assert result.exit_code == 0, result.output
    checkpoint_modes = {stat.S_IMODE(p.stat().st_mode) for p in (tiny_run.run_dir / "save-2").iterdir()}
    exported_modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert exported_modes == {"model.safetensors": _new_file_mode()}  # 0o644 under umask 022
    assert checkpoint_modes == {_new_file_mode()}


def test_a_non_empty_out_is_replaced_like_export_dir(runner, tiny_run, tmp_path):
    """As the trainer's export.dir: an earlier export's safetensors files are replaced, others kept."""
    out = tmp_path / "o"
    first = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", str(out), "--step", "2"])
    assert first.exit_code == 0, first.output
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00003.safetensors").write_text("stale shard of an older layout")
    again = runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", str(out)])
    assert again.exit_code == 0, again.output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"
    assert runner.invoke(cli, ["export", str(tiny_run.run_dir), "--out", str(fresh)]).exit_code == 0
    a, b = _weights(out), _weights(fresh)
    assert all((a[k] == b[k]).all() for k in a)  # step 4's weights, not step 2's


_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (INFO|WARNING) +\[local\] +d9d\.[a-z]+: ")


def test_export_prints_one_log_format_and_loads_the_checkpoint_once(tiny_run, tmp_path):
    done = run_cli("export", str(tiny_run.run_dir), "--out", str(tmp_path / "o"), "--step", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines and all(_LOG_LINE.match(line) for line in lines), lines
    assert sum("checkpoint loaded" in line for line in lines) == 1
    assert not any("changed setting" in line for line in lines)  # its mesh was 1 process already
    assert re.search(r"d9d\.cli: export finished +step=2 ", lines[-1])


def test_export_in_a_subprocess(tiny_run, tmp_path):
    ok = run_cli("export", str(tiny_run.run_dir), "--out", str(tmp_path / "o"), "--step", "2")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "embed.weight" in json.dumps(sorted(_weights(tmp_path / "o")))
    (tmp_path / "f").write_text("x")
    bad = run_cli("export", str(tiny_run.run_dir), "--out", str(tmp_path / "f"))
    assert bad.returncode == 2 and "is a file" in bad.stderr and "Traceback" not in bad.stderr
