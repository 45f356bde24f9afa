"""`torchrun --max-restarts 2` with a rank that crashes once: the restarted job resumes by itself and
ends bit-identical to an uninterrupted run on the same mesh (losses, grad norms, LRs, weights)."""

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest
from _quickstart import CONFIG, TRAIN, RunResult, compare_runs, exported_weights, records, train
from faults._harness import STEPS, committed_steps, job_args

pytestmark = pytest.mark.slow

# torch 2.15 + gloo: the agent's store outlives a restart, and the process groups that a restarted
# attempt creates after the default one (device meshes, the checkpoint group) would read the dead
# attempt's addresses from it ("Gloo connectFullMesh failed ... Connection refused", or a hang).
# `DistributedContext.from_env` gives each TORCHELASTIC_RESTART_COUNT its own store namespace; this
# test is the regression test for that.

MESH = "mesh.data_parallel_shard=2"


def test_torchrun_restart_resumes_from_the_last_checkpoint_and_finishes(tmp_path):
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)

    # the uninterrupted run on the same mesh (FSDP 2), ranks forked from here
    uninterrupted = train(2, job_args(tmp_path, "uninterrupted", STEPS, MESH))
    exported = RunResult(uninterrupted.records, exported_weights(tmp_path / "uninterrupted-export"))
    compare_runs(exported, uninterrupted, rel=0)  # the export holds exactly the trained weights

    marker = tmp_path / "crashed-once"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "D9D_TEST_RAISE_AT_STEP": "5",
        "D9D_TEST_RAISE_RANK": "1",
        "D9D_TEST_RAISE_ONCE": str(marker),
    }
    args = job_args(tmp_path, "run", STEPS, MESH)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", TRAIN, CONFIG, *args]  # fmt: skip
    # Own session: on a timeout the agent *and* its workers go (an orphaned worker would hang on).
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert marker.exists(), "the injected crash did not happen"
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: rank 1 failed in step 5: RuntimeError: injected failure on rank 1 at step 5 "
        "(D9D_TEST_RAISE_AT_STEP) (traceback in rank 1's log)"
    ], errors
    assert "d9d.trainer: resumed" in output and "checkpoint=" in output
    lines = output.splitlines()
    committed = [re.search(r"step=(\d+)", x).group(1) for x in lines if "d9d.ckpt: checkpoint committed" in x]
    assert committed and len(committed) == len(set(committed)), committed  # one line a save, not a rank
    assert sum("d9d.trainer: exported" in x for x in lines) == 1  # rank 0's, once for the job
    assert sum("d9d.trainer: run summary" in x for x in lines) == 1, [x for x in lines if "run summary" in x]
    resumed = [line for line in output.splitlines() if "d9d.trainer: resumed" in line]
    assert all("step=4" in line for line in resumed) and len(resumed) == 2, resumed  # both ranks
    run = tmp_path / "run"
    assert [r["step"] for r in records(run)] == list(range(1, STEPS + 1))  # steps 5.. redone once, not twice
    assert committed_steps(run) == [STEPS - 2, STEPS]
    # the same mesh, so the same reduction order: bit-identical, step by step and in every weight
    compare_runs(RunResult.read(run, tmp_path / "run-export"), exported, rel=0)
