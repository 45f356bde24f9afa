"""`d9d metrics`: the summary of a metrics file, restarts, and the plot (or its clear refusal)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli

from d9d.cli import cli
from d9d.cli.commands.metrics import PLOT_INSTALL_HINT, find_restarts, read_metrics, summarize
from d9d.trainer.observe.metrics_file import METRICS_FILE


def _record(step, loss, tokens=100.0, time=0.5, **extra):
    return {
        "step": step,
        "loss": loss,
        "grad_norm": 1.0,
        "lr": 0.1,
        "tokens": tokens,
        "step_time_s": time,
        "skipped": False,
        **extra,
    }


def _write(path: Path, records, tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def test_a_damaged_line_is_skipped_and_counted_as_the_trainer_reads_it(tmp_path):
    from d9d.trainer.observe.metrics_file import read_metrics_file

    run = _write(
        tmp_path / "run", [_record(1, 3.0)], tail='{"step": 2, "lo\n' + json.dumps(_record(3, 2.0)) + "\n"
    )
    records, bad = read_metrics(run / METRICS_FILE)
    trainers = read_metrics_file(run / METRICS_FILE)
    assert (
        (records, bad) == (trainers.records, len(trainers.damaged)) == ([_record(1, 3.0), _record(3, 2.0)], 1)
    )


def test_summary_of_a_run_with_a_restart():
    records = [_record(1, 3.0), _record(2, 2.0), _record(3, 2.5), _record(2, 1.5, time=1.0), _record(3, 1.8)]
    assert find_restarts(records) == [(3, 2)]
    s = summarize(records)
    assert (s.first_step, s.last_step, s.records) == (1, 3, 5)
    # step 2 and 3 count once, as their last records
    assert (s.first_loss, s.last_loss, s.min_loss, s.min_loss_step) == (3.0, 1.8, 1.5, 2)
    assert s.tokens_per_s == pytest.approx(300.0 / 2.0)


def test_a_launch_field_marks_restarts_without_a_step_gap():
    records = [_record(1, 3.0, launch="a"), _record(2, 2.0, launch="a"), _record(3, 1.0, launch="b")]
    assert find_restarts(records) == [(2, 3)]


def test_cli_summary_of_a_real_run(runner, tiny_run):
    result = runner.invoke(cli, ["metrics", str(tiny_run.run_dir)])
    assert result.exit_code == 0, result.output
    records, bad = read_metrics(tiny_run.run_dir / METRICS_FILE)
    assert bad == 0 and [r["step"] for r in records] == [1, 2, 3, 4]
    assert "steps: 1..4 (4 steps)" in result.output
    assert f"last {records[-1]['loss']:.4f}" in result.output
    assert "restarts: 0" in result.output


def test_cut_off_line_is_skipped_and_counted(runner, tmp_path):
    run = _write(tmp_path / "run", [_record(1, 2.0), _record(2, 1.0)], tail='{"step": 3, "lo')
    result = runner.invoke(cli, ["metrics", str(run)])
    assert result.exit_code == 0, result.output
    assert "1 unreadable line skipped" in result.output and "steps: 1..2" in result.output


def test_plot_without_matplotlib_says_how_to_install(runner, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    run = _write(tmp_path / "run", [_record(1, 2.0)])
    result = runner.invoke(cli, ["metrics", str(run), "--plot", str(tmp_path / "m.png")])
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert (
        "uv sync --all-packages --inexact --extra plot" in result.stderr
        and "pip install 'd9d-cli[plot]'" in result.stderr
    )
    assert not (tmp_path / "m.png").exists()


def _colour_pixels(png: Path, colour: str) -> int:
    """How many pixels of the PNG are (close to) matplotlib's colour `colour` (e.g. "C0")."""
    import matplotlib.colors
    import matplotlib.image

    pixels = matplotlib.image.imread(png)[..., :3]
    want = matplotlib.colors.to_rgb(colour)
    return int((abs(pixels - want).max(axis=-1) < 0.06).sum())


def test_plot_draws_a_png(runner, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    run = _write(tmp_path / "run", [_record(1, 2.0), _record(2, 1.0), _record(1, 1.5)])
    result = runner.invoke(cli, ["metrics", str(run), "--plot", str(tmp_path / "m.png")])
    assert result.exit_code == 0, result.output
    png = tmp_path / "m.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (800, 880)  # 8 × 8.8 inches at 100 dpi: four panels
    assert _colour_pixels(png, "C0") > 200  # the curves were drawn, not only the axes


def test_several_runs_are_summarized_and_overlaid_in_one_plot(runner, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    a = _write(tmp_path / "lr-small", [_record(s, 3.0 - 0.1 * s) for s in range(1, 11)])
    b = _write(
        tmp_path / "lr-big", [_record(s, 3.0 - 0.2 * s, eval_loss=2.5 - 0.1 * s) for s in range(1, 11)]
    )
    png = tmp_path / "cmp.png"
    result = runner.invoke(cli, ["metrics", str(a), str(b), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert result.output.count("steps: 1..10 (10 steps)") == 2
    assert "eval loss: 1.5000 (step 10)" in result.output  # b's last eval
    trends = [
        line.removeprefix("loss trend: ") for line in result.output.splitlines() if "loss trend" in line
    ]
    bars = "▁▂▃▄▅▆▇█"
    for trend in trends:  # falling losses: a falling line, highest bar first, lowest last
        heights = [bars.index(c) for c in trend]
        assert len(heights) == 10 and heights[0] == 7 and heights[-1] == 0
        assert heights == sorted(heights, reverse=True)
    assert matplotlib.image.imread(png).shape[0] == 1100  # a fifth panel: eval loss
    assert _colour_pixels(png, "C0") > 200 and _colour_pixels(png, "C1") > 200  # one colour per run


def test_sparkline():
    from d9d.cli.commands.metrics import sparkline

    assert sparkline([]) == ""
    assert sparkline([1.0, 1.0, 1.0]) == "▄▄▄"
    assert sparkline([0.0, 1.0]) == "▁█"
    assert len(sparkline([float(i) for i in range(1000)], width=40)) == 40


@pytest.mark.parametrize("case", ["missing", "no-metrics", "empty"])
def test_errors_are_one_line(runner, tmp_path, case):
    path = tmp_path / "run"
    if case == "no-metrics":
        (path / "save-2").mkdir(parents=True)
    if case == "empty":
        _write(path, [])
    result = runner.invoke(cli, ["metrics", str(path)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")


def test_metrics_in_a_subprocess(tiny_run, tmp_path):
    ok = run_cli("metrics", str(tiny_run.run_dir))
    assert ok.returncode == 0, ok.stderr
    assert "steps: 1..4" in ok.stdout
    code = "import sys; sys.modules['matplotlib'] = None; from d9d.cli import main; main()"
    import subprocess

    no_mpl = subprocess.run(
        [sys.executable, "-c", code, "metrics", str(tiny_run.run_dir), "--plot", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert no_mpl.returncode == 2 and PLOT_INSTALL_HINT in no_mpl.stderr
    assert len(no_mpl.stderr.strip().splitlines()) == 1
    missing = run_cli("metrics", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")


def test_metrics_of_a_run_directory_imports_no_torch(tiny_run):
    """The run's names are d9d-ckpt's (which imports torch); a run with a metrics file needs none of them."""
    import subprocess

    code = (
        "import sys; from d9d.cli import main; sys.argv = ['d9d', 'metrics', sys.argv[1]]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_run.run_dir)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "steps: 1..4" in out.stdout and out.stderr.strip().splitlines()[-1] == "False", out.stderr


def test_the_plot_hint_names_a_uv_command_that_installs_matplotlib_here():
    """The uv command of the hint resolves matplotlib from this workspace's lock (dry run: installs nothing)."""
    import os
    import re
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[3]
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None or not (root / "uv.lock").is_file():
        pytest.skip("needs uv and the d9d workspace")
    command = re.search(r"`(uv sync [^`]*)`", PLOT_INSTALL_HINT)
    assert command is not None, PLOT_INSTALL_HINT
    args = command.group(1).split()[1:]
    out = subprocess.run(
        [uv, *args, "--frozen", "--dry-run", "--offline"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "matplotlib" in out.stdout + out.stderr or "Would make no changes" in out.stdout + out.stderr


def test_a_run_path_taken_from_the_wrong_directory_names_the_real_place(runner, tmp_path, monkeypatch):
    _write(tmp_path / "examples" / "job" / "runs" / "demo", [_record(1, 2.0)])
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(cli, ["metrics", "runs/demo"])
    assert result.exit_code == 2
    assert (
        "did you mean examples/job/runs/demo?" in result.stderr
        and "relative to the config file" in result.stderr
    )
