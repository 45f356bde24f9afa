"""`d9d export`: from a run directory (config stored in the checkpoint) or from the config file."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli, write_job

from d9d.cli import cli
from d9d.cli.commands.export import find_config_dir, relative_provider_files
from d9d.trainer import METRICS_FILE


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
    assert "exported step 4" in latest.output
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


@pytest.mark.parametrize("case", ["missing-step", "out-not-empty", "no-such-path", "no-checkpoints"])
def test_export_errors_are_one_line(runner, tiny_run, tmp_path, case):
    out = tmp_path / "out"
    args = ["export", str(tiny_run.run_dir), "--out", str(out)]
    if case == "missing-step":
        args += ["--step", "3"]
    elif case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("x")
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


def test_export_in_a_subprocess(tiny_run, tmp_path):
    ok = run_cli("export", str(tiny_run.run_dir), "--out", str(tmp_path / "o"), "--step", "2")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "embed.weight" in json.dumps(sorted(_weights(tmp_path / "o")))
    bad = run_cli("export", str(tiny_run.run_dir), "--out", str(tmp_path / "o"))
    assert bad.returncode == 2 and "not an empty directory" in bad.stderr and "Traceback" not in bad.stderr
