"""What a resume refuses or adapts to, through train.py's `main()`: another optimizer (refused with
the fix, or reset on request), a changed seed (noticed in one line), and relative paths taken from the
config file's directory wherever the job is started from. The refusal runs as a real `python train.py`
process (its exit status and its one stderr line are the contract), the seed job through the fault
harness's `start_job`; the other runs are forked from the test process (`run_main`: the same `main()`,
its exit status and output, without an interpreter start-up each)."""

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from _quickstart import CONFIG, TINY, overrides, records, run_local, run_main
from faults._harness import start_job

from d9d.ckpt import CheckpointManager


def _snapshot(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_a_resume_with_another_optimizer_is_refused_with_the_fix_then_reset_on_request(tmp_path):
    base = [*TINY, f"trainer.checkpointing.save_dir={tmp_path}", "trainer.run.name=opt"]
    first = run_main([*base, "trainer.schedule.total_steps=2"])
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = tmp_path / "opt"
    before = _snapshot(run_dir)

    refused = run_local([*base, "trainer.schedule.total_steps=4", "optimizer.name=sgd", "optimizer.lr=0.1"])
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith("error: the optimizer changed since checkpoint ")
    assert "optimizer.name adamw → sgd" in lines[0] and "trainer.resume.reset_optimizer=true" in lines[0]
    after = _snapshot(run_dir)
    assert {k: v for k, v in after.items() if not k.startswith("logs")} == before  # nothing written

    reset = run_main(
        [*base, "trainer.schedule.total_steps=4", "optimizer.name=sgd", "optimizer.lr=0.1",
         "trainer.resume.reset_optimizer=true"]
    )  # fmt: skip
    assert reset.returncode == 0, reset.stderr[-2000:]
    assert "optimizer state reset" in reset.stdout
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]
    with CheckpointManager(tmp_path, "opt") as manager:
        assert [c.step for c in manager.checkpoints()] == [2, 4]

    # The checkpoint now records SGD: the same command resumes with its state (no reset, no refusal).
    again = run_main(
        [*base, "trainer.schedule.total_steps=6", "optimizer.name=sgd", "optimizer.lr=0.1",
         "trainer.resume.reset_optimizer=true"]
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "optimizer state reset" not in again.stdout


def test_a_resume_with_a_changed_seed_says_so_in_one_line(tmp_path):
    """The checkpoint's RNG state wins over the new seed; the resume says which setting changed."""
    first = start_job(overrides(tmp_path, "seed", 2), tmp_path / "first.log")
    assert first.wait() == 0, first.output()[-3000:]
    resumed = start_job(
        overrides(tmp_path, "seed", 4, "trainer.determinism.seed=7"), tmp_path / "resumed.log"
    )
    assert resumed.wait() == 0, resumed.output()[-3000:]
    notices = [line for line in resumed.output().splitlines() if "resumed with a changed setting" in line]
    assert len(notices) == 2, resumed.output()[-3000:]  # the seed, and total_steps 2 -> 4
    (seed,) = [line for line in notices if "key=trainer.determinism.seed" in line]
    assert "WARNING" in seed and seed.endswith("checkpoint=0  now=7"), seed
    assert [r["step"] for r in records(tmp_path / "seed")] == [1, 2, 3, 4]  # it resumed at step 2


def test_relative_paths_of_a_config_are_taken_from_its_directory_wherever_the_job_starts(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    config = yaml.safe_load(Path(CONFIG).read_text(encoding="utf-8"))
    config["providers"] = {
        k: str(Path(CONFIG).parent / v) if ".py:" in v else v for k, v in config["providers"].items()
    }
    config["dataset"]["path"] = str((Path(CONFIG).parent / config["dataset"]["path"]).resolve())
    config["trainer"]["checkpointing"]["save_dir"] = "runs"
    config["trainer"]["logging"]["log_dir"] = "logs"
    config["export"] = {"dir": "exported"}
    (job / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    elsewhere = [tmp_path / "a", tmp_path / "b"]
    for cwd in elsewhere:
        cwd.mkdir()

    def run(cwd: Path, steps: int) -> subprocess.CompletedProcess[str]:
        return run_main(
            [*TINY, f"trainer.schedule.total_steps={steps}"], config=str(job / "config.yaml"), cwd=cwd
        )

    first = run(elsewhere[0], 2)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run(elsewhere[1], 4)  # from another directory: the same run resumes
    assert second.returncode == 0, second.stderr[-2000:]
    run_dir = job / "runs" / "quickstart"
    assert f"run_dir={run_dir}" in second.stdout
    assert "resumed" in second.stdout
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]
    assert (job / "logs" / "rank-0.log").is_file() and any((job / "exported").glob("*.safetensors"))
    (exported,) = [
        x for x in second.stdout.splitlines() if "d9d.trainer: exported" in x
    ]  # the files it wrote
    assert f"weights={sorted(p.name for p in (job / 'exported').glob('*.safetensors'))}" in exported, exported
    # the file starts once the job did (after its first step), with the lines logged before it
    log = (job / "logs" / "rank-0.log").read_text(encoding="utf-8")
    assert log.count("d9d.trainer: job built") == 2, log[-3000:]
    assert len(re.findall(r"d9d\.trainer: resumed +step=2", log)) == 1, log[-3000:]
    assert all(not any(cwd.iterdir()) for cwd in elsewhere)  # nothing written where the jobs started
    shutil.rmtree(job / "runs")
