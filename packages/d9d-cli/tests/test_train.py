"""`d9d train`: in process, under a real torchrun (2 ranks), and its one-line errors."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli, write_job

from d9d.cli import cli
from d9d.mesh.testing import run_torchrun
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / METRICS_FILE).read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_train_runs_and_a_finished_run_exits_0(runner, tiny_run):
    assert len(_losses(tiny_run.run_dir)) == 4
    again = runner.invoke(
        cli,
        ["train", str(tiny_run.config), "--set", f"trainer.checkpointing.save_dir={tiny_run.run_dir.parent}"],
    )
    assert again.exit_code == 0, again.output
    assert "already complete" in again.output
    assert len(_losses(tiny_run.run_dir)) == 4


def _files(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def test_a_finished_run_checks_its_providers_sections_before_it_says_it_is_complete(runner, tiny_run, capsys):
    """A key the model provider does not have (`model.num_head`) fails a finished run as it fails a new
    one: exit 2, the same one line, through `d9d train` and train.py's `main()`; nothing is written."""
    from d9d.trainer import main

    save_dir = f"trainer.checkpointing.save_dir={tiny_run.run_dir.parent}"
    before = _files(tiny_run.run_dir)
    typo = runner.invoke(cli, ["train", str(tiny_run.config), "--set", save_dir, "--set", "model.num_head=4"])
    assert typo.exit_code == 2, typo.output
    (line,) = typo.stderr.strip().splitlines()
    assert line.startswith("error: ") and "model.num_head" in line and "already complete" not in typo.output
    fresh = runner.invoke(cli, ["train", str(tiny_run.config), "--set", "model.num_head=4"])  # no run yet
    assert fresh.exit_code == 2 and fresh.stderr.strip() == line, fresh.stderr
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # `python train.py CONFIG ...`
        main([str(tiny_run.config), save_dir, "model.num_head=4"])
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == line
    assert _files(tiny_run.run_dir) == before
    valid = runner.invoke(cli, ["train", str(tiny_run.config), "--set", save_dir])
    assert valid.exit_code == 0 and "run is already complete" in valid.output, valid.output


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["trainer.schedule.total_steps=zero"], "trainer.schedule.total_steps"),
        (["trainer.bogus=1"], "unknown key trainer.bogus"),
        (["providers.model=tiny_job.py:Missing"], "Missing"),
        (["mesh.data_parallel_shard=0"], "mesh.data_parallel_shard must be >= 1"),
        (["mesh.data_parallel_shard=2"], "needs 2 processes"),  # launched as one plain process
    ],
    ids=["wrong-type", "unknown-key", "bad-provider", "bad-degree", "mesh-mismatch"],
)
def test_config_errors_are_one_line(runner, tiny_run, sets, expected):
    args = ["train", str(tiny_run.config)] + [arg for item in sets for arg in ("--set", item)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]


def test_missing_config_and_debug_traceback(runner, tiny_run, tmp_path):
    missing = runner.invoke(cli, ["train", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such config file" in missing.stderr
    debug = runner.invoke(cli, ["--debug", "train", str(tmp_path / "nope.yaml")])
    assert debug.exit_code != 0 and type(debug.exception).__name__ == "CliError"
    bad_key = runner.invoke(cli, ["--debug", "train", str(tiny_run.config), "--set", "trainer.bogus=1"])
    assert type(bad_key.exception).__name__ == "ConfigError"


def test_train_error_in_a_subprocess(tmp_path):
    out = run_cli("train", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    debug = run_cli("--debug", "train", str(tmp_path / "nope.yaml"))
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "CliError" in debug.stderr


@pytest.mark.slow
def test_train_under_torchrun_fsdp2_matches_one_process(tiny_run, tmp_path):
    config = write_job(tmp_path / "job")
    sets = ["mesh.data_parallel_shard=2", f"trainer.checkpointing.save_dir={tmp_path / 'runs'}"]
    result = run_torchrun(
        ["-m", "d9d.cli", "train", str(config), *[arg for item in sets for arg in ("--set", item)]],
        nproc_per_node=2,
        timeout=180,
    )
    assert result.returncode == 0, result.output[-4000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert (run_dir / "save-4" / "commit.json").is_file()
    assert _losses(run_dir) == pytest.approx(_losses(tiny_run.run_dir), rel=1e-5, abs=1e-6)
