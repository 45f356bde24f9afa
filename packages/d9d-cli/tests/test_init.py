"""`d9d init`: a quickstart that runs from any directory, and never overwrites a file."""

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli

from d9d.cli import cli
from d9d.cli.commands.init import TEMPLATE_FILES
from d9d.trainer import load_job_config, resolve_job

# A few steps of a smaller model, so the test stays fast; the shipped config itself is checked as is.
TINY = [
    "trainer.schedule.total_steps=2",
    "trainer.checkpointing.period_steps=0",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "dataset.seq_len=32",
    "data.global_batch_size=4",
    "data.microbatch_size=2",
]


def test_init_writes_a_valid_job(runner, tmp_path):
    target = tmp_path / "new" / "job"
    result = runner.invoke(cli, ["init", str(target)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in target.iterdir()) == sorted(TEMPLATE_FILES)
    loaded = load_job_config(target / "config.yaml")
    job = resolve_job(loaded)  # imports train.py from the new directory
    assert type(job.model_provider).__name__ == "QuickstartModelProvider"
    raw = yaml.safe_load((target / "config.yaml").read_text())
    assert raw["dataset"]["path"] == "corpus.txt" and (target / "corpus.txt").stat().st_size > 10_000


def test_init_refuses_to_overwrite(runner, tmp_path):
    (tmp_path / "config.yaml").write_text("mine")
    result = runner.invoke(cli, ["init", str(tmp_path)])
    assert result.exit_code == 2
    assert "config.yaml already exists" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "config.yaml").read_text() == "mine"
    assert not (tmp_path / "train.py").exists()  # nothing written


def test_init_into_a_file_is_an_error(runner, tmp_path):
    (tmp_path / "f").write_text("x")
    result = runner.invoke(cli, ["init", str(tmp_path / "f")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_init_then_train_from_another_directory(tmp_path):
    made = run_cli("init", "job", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sets = [arg for item in TINY for arg in ("--set", item)]
    ran = run_cli("train", str(tmp_path / "job" / "config.yaml"), *sets, cwd=elsewhere)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert (elsewhere / "runs" / "quickstart" / "save-2").is_dir()
    again = run_cli("init", "job", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "Traceback" not in again.stderr
