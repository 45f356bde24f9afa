"""A save that hits a full disk: one error that says so, the previous checkpoint stays intact and the latest."""

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults._harness import STEPS, committed_steps, job_args, losses, start_job, step_dirs

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _no_space_from_the_second_save() -> None:
    """In the job process: every file of the checkpoint of step 4 fails as on a full disk."""
    from torch.distributed.checkpoint import filesystem

    create_stream = filesystem.FileSystem.create_stream

    def full(self: filesystem.FileSystem, path: str | os.PathLike[str], mode: str):  # type: ignore[no-untyped-def]
        if ".save-4." in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return create_stream(self, path, mode)

    filesystem.FileSystem.create_stream = full  # type: ignore[method-assign]


def _check_failed_save(tmp: Path, save_dir: Path, job_output: str) -> None:
    errors = [line for line in job_output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, job_output[-3000:]
    assert errors[0].startswith(
        f"error: no space left on device while writing checkpoint step 4 to {save_dir / 'run'}; the previous "
        "checkpoint stays the latest; free space or set trainer.checkpointing.save_dir ("
    ), errors
    assert "[Errno 28] No space left on device" in errors[0], errors  # what failed, and where
    assert "Traceback" not in job_output
    run = save_dir / "run"
    assert committed_steps(run) == [2] and step_dirs(run) == [2]
    assert not list(run.glob(".save-*")), "the failed save's files were left behind"


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, reference, how):
    # One checkpoint of the tiny model (with AdamW state) is ~1.5 MB: the first fits, the second not.
    with contextlib.ExitStack() as stack:
        if how == "tmpfs":
            save_dir = stack.enter_context(_tmpfs(tmp_path / "disk", "2500k"))
            job = start_job(job_args(save_dir, "run", STEPS), tmp_path / "full.log")
        else:
            save_dir = tmp_path / "disk"
            job = start_job(
                job_args(save_dir, "run", STEPS), tmp_path / "full.log", setup=_no_space_from_the_second_save
            )
        assert job.wait() == 2, job.output()[-3000:]
        _check_failed_save(tmp_path, save_dir, job.output())
        if how == "tmpfs":
            subprocess.run(["mount", "-o", "remount,size=64m", str(save_dir)], check=True)
        resumed = start_job(job_args(save_dir, "run", STEPS), tmp_path / "resumed.log")
        assert resumed.wait() == 0, resumed.output()[-3000:]
        assert "resumed" in resumed.output() and "step=2" in resumed.output()
        weights, expected = reference
        assert losses(save_dir / "run") == expected
        assert (save_dir / "run-export" / "model.safetensors").read_bytes() == weights
