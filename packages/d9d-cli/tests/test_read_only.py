"""`d9d checkpoints` and `d9d export` read a run that a training job holds (its run lock) and write nothing there."""

import hashlib
import re
import shutil
from pathlib import Path

from d9d.cli import cli
from d9d.mesh import DistributedContext
from d9d.trainer.faults.run_lock import RunLock


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


def test_checkpoints_and_export_read_a_locked_run_without_writing(runner, tiny_run, tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / tiny_run.run_dir.name
    shutil.copytree(tiny_run.run_dir, run_dir)
    monkeypatch.chdir(tmp_path)
    lock = RunLock.acquire(run_dir, DistributedContext.from_env(environ={}))  # as a training job holds it
    try:
        before = _snapshot(run_dir)
        listed = runner.invoke(cli, ["checkpoints", str(run_dir)])
        assert listed.exit_code == 0, listed.output
        assert "in use" not in listed.output and "save-" not in listed.stderr
        exported = runner.invoke(cli, ["export", str(run_dir), "--out", "out"])
        assert exported.exit_code == 0, exported.output
        assert re.search(r"d9d\.cli: export finished +step=4 ", exported.output), exported.output
        from_config = runner.invoke(
            cli,
            [
                "export",
                str(tiny_run.config),
                "--out",
                "out2",
                f"trainer.checkpointing.save_dir={run_dir.parent}",
            ],
        )
        assert from_config.exit_code == 0, from_config.output
        assert any((tmp_path / "out").glob("*.safetensors")) and any(
            (tmp_path / "out2").glob("*.safetensors")
        )
        assert _snapshot(run_dir) == before  # read only: the live job's files are untouched
    finally:
        lock.release()
