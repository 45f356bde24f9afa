"""One override syntax for `d9d train` and `python train.py`: bare `key=val`, `--set key=val`, or both."""

import json

import pytest

from d9d.cli import cli
from d9d.trainer import main
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _steps(run_dir) -> int:
    return len((run_dir / METRICS_FILE).read_text().splitlines())


def test_cli_takes_bare_and_set_overrides_together(runner, tiny_run, tmp_path):
    args = ["train", str(tiny_run.config), f"trainer.checkpointing.save_dir={tmp_path}"]
    result = runner.invoke(cli, [*args, "--set", "trainer.run.name=mixed", "trainer.schedule.total_steps=2"])
    assert result.exit_code == 0, result.output
    assert _steps(tmp_path / "mixed") == 2


def test_cli_bare_override_is_checked_by_the_schema(runner, tiny_run):
    result = runner.invoke(cli, ["train", str(tiny_run.config), "trainer.bogus=1"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "unknown key trainer.bogus" in lines[0]


@pytest.mark.parametrize("command", ["train", "plan", "export"])
def test_cli_argument_that_is_not_an_override_is_a_usage_error(runner, tiny_run, command):
    extra = ["--out", "x"] if command == "export" else []
    result = runner.invoke(cli, [command, str(tiny_run.config), *extra, "total_steps"])
    assert result.exit_code == 2, result.output
    assert "unexpected argument 'total_steps': an override looks like key.path=value" in result.stderr


def test_cli_set_with_nothing_after_it_is_a_usage_error(runner, tiny_run):
    result = runner.invoke(cli, ["train", str(tiny_run.config), "--set"])
    assert result.exit_code == 2 and "'--set' requires an argument" in result.stderr


def test_script_takes_set_then_bare_overrides(tiny_run, tmp_path):
    main([str(tiny_run.config), "--set", f"trainer.checkpointing.save_dir={tmp_path}", "trainer.run.name=both",
          "--set=trainer.schedule.total_steps=2"])  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "both" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


@pytest.mark.parametrize("tail", [["--set"], ["--set", "--set", "a=b"], ["a=b", "--set"]])
def test_script_set_with_nothing_after_it_is_one_error_line(tiny_run, tmp_path, capsys, tail):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tiny_run.config), *tail])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["error: --set needs an override after it: key.path=value"]
