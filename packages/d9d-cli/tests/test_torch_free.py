"""What needs no model never imports torch: help, listing and verifying checkpoints, config errors; and a
finished run builds nothing, but checks its providers' sections first (each in a fresh interpreter, as
the `d9d` console script runs it)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import _env

# Runs the console script's main() and prints, last on stderr, its exit status and the heavy modules it
# imported by the time it exited.
_RUN = """
import json, sys
sys.argv = ["d9d", *sys.argv[1:]]
code = 0
try:
    from d9d.cli import main
    main()
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
heavy = sorted(m for m in ("torch", "numpy", "safetensors") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def _d9d(*args: str, cwd: Path | None = None) -> tuple[int, list[str], str, str]:
    """(exit status, heavy modules imported, stdout, stderr without the report) of `d9d ARGS`."""
    out = subprocess.run(
        [sys.executable, "-c", _RUN, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120
    )
    *lines, report = out.stderr.strip().splitlines() or [""]
    status = json.loads(report)
    return status["code"], status["heavy"], out.stdout, "\n".join(lines)


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["train", "--help"], ["checkpoints", "-h"]])
def test_help_imports_no_torch(args):
    code, heavy, stdout, _ = _d9d(*args)
    assert code == 0 and stdout.startswith("Usage: d9d")
    assert heavy == []


def test_listing_and_verifying_checkpoints_import_no_torch(tiny_run, tmp_path):
    code, heavy, stdout, err = _d9d("checkpoints", str(tiny_run.run_dir))
    assert code == 0, err
    assert [line.split()[0] for line in stdout.splitlines()[2:]] == ["2", "4"]  # the run's two saves
    assert "torch" not in heavy
    code, heavy, stdout, err = _d9d("checkpoints", "--verify", str(tiny_run.run_dir))
    assert code == 0, err
    assert "verified 2 checkpoint(s): 0 damaged" in stdout
    assert "torch" not in heavy


def test_a_damaged_checkpoint_is_listed_without_torch(tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    shard = max((run / "save-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated after its commit
    code, heavy, stdout, err = _d9d("checkpoints", str(run))
    assert code == 0, err
    assert "damaged: 1 file resized" in stdout
    assert "torch" not in heavy


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["trainer.bogus=1"], "unknown key trainer.bogus"),
        (["pipelining.schedule=nope"], "pipelining.schedule"),
        (["mesh.data_parallel_shard=2", "mesh.tensor_parallel=2"], "needs 4"),
    ],
    ids=["unknown-key", "unknown-schedule", "mesh-product"],
)
def test_config_errors_import_no_torch(tiny_run, command, sets, expected):
    size = ["--world-size", "2"] if command == "plan" else []  # train: one plain process
    code, heavy, _, err = _d9d(command, str(tiny_run.config), *size, *[a for s in sets for a in ("--set", s)])
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and expected in err, err
    assert "torch" not in heavy


def test_a_finished_run_says_so_without_building(tiny_run, tmp_path):
    """A restarted finished run is decided from its latest commit record: no model, no checkpoint load,
    nothing written (its providers' sections are checked first: test_train.py)."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    before = {p.name: p.stat().st_mtime_ns for p in run.rglob("*")}
    code, _, stdout, err = _d9d(
        "train", str(tiny_run.config), "--set", f"trainer.checkpointing.save_dir={run.parent}"
    )
    assert code == 0, err
    assert "run is already complete" in stdout and "step=4" in stdout and "total_steps=4" in stdout
    assert "job built" not in stdout and "checkpoint loaded" not in stdout and "resumed" not in stdout
    assert {p.name: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written


def test_a_finished_run_with_more_steps_resumes_and_trains(tiny_run, tmp_path):
    """The early answer is for a finished run only: raising total_steps loads save-4 and trains on."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    code, heavy, stdout, err = _d9d(
        "train",
        str(tiny_run.config),
        "--set",
        f"trainer.checkpointing.save_dir={run.parent}",
        "--set",
        "trainer.schedule.total_steps=6",
    )
    assert code == 0, err
    assert "job built" in stdout and "resumed" in stdout and "step=4" in stdout
    assert (run / "save-6").is_dir() and "already complete" not in stdout
    assert "torch" in heavy


def test_a_finished_run_with_an_uncommitted_save_is_refused_as_before(tiny_run, tmp_path):
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    (run / "save-6").mkdir()  # not d9d's: a save is named save-<step> only once committed
    code, _, _, err = _d9d(
        "train", str(tiny_run.config), "--set", f"trainer.checkpointing.save_dir={run.parent}"
    )
    assert code == 2 and "save-6" in err, err


def test_a_finished_run_through_train_py_does_not_build(tiny_run, tmp_path):
    """`python train.py CONFIG` (d9d.trainer.main) takes the same path as `d9d train`."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    config = yaml.safe_load(tiny_run.config.read_text())
    config["trainer"]["checkpointing"]["save_dir"] = str(run.parent)
    shutil.copy(tiny_run.config.parent / "tiny_job.py", tmp_path)  # the providers, beside the config
    (tmp_path / "finished.yaml").write_text(yaml.safe_dump(config))
    script = "from d9d.trainer import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "finished.yaml")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "run is already complete" in out.stdout and "job built" not in out.stdout


def test_checkpoints_marks_the_best_by_the_recorded_eval_loss_and_export_best_refuses_without_one(
    tiny_run, tmp_path
):
    run_dir = tmp_path / "tiny"
    shutil.copytree(tiny_run.run_dir, run_dir)
    code, heavy, stdout, err = _d9d("export", str(run_dir), "--out", str(tmp_path / "out"), "--best")
    assert code == 2 and "has no checkpoint that records eval_loss" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    for step, loss in ((2, 1.5), (4, 2.5)):  # as a run with eval: would have recorded them
        commit = run_dir / f"save-{step}" / "commit.json"
        record = json.loads(commit.read_text())
        commit.write_text(json.dumps({**record, "metrics": {"eval_loss": loss}, "metrics_step": step}))
    code, heavy, stdout, err = _d9d("checkpoints", str(run_dir))
    assert code == 0, err
    rows = {line.split()[0]: line for line in stdout.splitlines()[2:]}
    assert rows["2"].endswith("1.5  best 1") and rows["4"].endswith("2.5")
    assert "torch" not in heavy


def test_a_finished_run_whose_export_is_in_place_is_not_rebuilt(tiny_run, tmp_path):
    """With `export.dir`, the first restart of a finished run exports (building the model, once); the
    next one finds the export recorded for the latest step and builds nothing; without the folder it
    exports again."""
    run = tmp_path / "runs" / "tiny"
    shutil.copytree(tiny_run.run_dir, run)
    sets = [
        "--set",
        f"trainer.checkpointing.save_dir={run.parent}",
        "--set",
        f"export.dir={tmp_path / 'out'}",
    ]
    code, heavy, stdout, err = _d9d("train", str(tiny_run.config), *sets)
    assert code == 0 and "exported" in stdout and "torch" in heavy, err
    assert json.loads((run / "exported.json").read_text()) == {"step": 4, "dir": str(tmp_path / "out")}
    code, heavy, stdout, err = _d9d("train", str(tiny_run.config), *sets)
    assert code == 0 and "run is already complete" in stdout and f"export={tmp_path / 'out'}" in stdout, err
    assert "job built" not in stdout and "exported" not in stdout.replace("exported.json", "")
    shutil.rmtree(tmp_path / "out")
    code, heavy, stdout, err = _d9d("train", str(tiny_run.config), *sets)
    assert code == 0 and "exported" in stdout and (tmp_path / "out").is_dir(), err
