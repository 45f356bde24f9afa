"""`d9d plan --launcher slurm` prints an sbatch script whose comments are the plan: it is parsed, and run
as Slurm would run it on one node (stub `scontrol` and `srun` on PATH, Slurm's variables set): its
torchrun line trains the job on 2 processes, `auto` resolved to 2 FSDP shards, with the losses of
one process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, NO_CLIP, SGD, TINY, train

from d9d.mesh.testing import free_port

pytestmark = pytest.mark.slow


def test_the_sbatch_script_parses_and_its_torchrun_line_trains_the_job(tmp_path):
    sets = [*TINY, *SGD, *NO_CLIP, f"trainer.checkpointing.save_dir={tmp_path}", "trainer.run.name=slurm",
            "trainer.schedule.total_steps=4", "mesh.data_parallel_shard=auto"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "d9d.cli", "plan", CONFIG, "--nnodes", "1", "--nproc-per-node",
                           "2", "--launcher", "slurm", *args], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    script = done.stdout
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = dict(
        re.fullmatch(r"#SBATCH --([\w-]+)=(.*)", x).groups() for x in lines if x.startswith("#SBATCH")
    )
    assert sbatch == {"job-name": "slurm", "nodes": "1", "ntasks-per-node": "1", "gpus-per-node": "2",
                      "output": "slurm-%j.out"}  # fmt: skip
    comments = [x for x in lines[1:] if x.startswith("#") and not x.startswith("#SBATCH")]
    assert "# mesh: data_parallel_shard=2 → world size 2" in comments  # the plan, as comments
    code = [x for x in lines if not x.startswith("#")]
    (srun,) = [x for x in code if x.startswith("srun ")]
    assert (
        '--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID"' in srun
        and "--nproc-per-node 2" in srun
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    # run it as Slurm would on one node: scontrol names the node, srun runs the task here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    job = tmp_path / "job.sbatch"
    job.write_text(script.replace(":29500", f":{free_port()}"))
    slurm = {"SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242",
             "PATH": f"{bin_dir}:{env['PATH']}"}  # fmt: skip
    ran = subprocess.run(
        ["bash", str(job)], capture_output=True, text=True, env={**env, **slurm}, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "mesh=data_parallel_shard=2" in ran.stdout
    records = [json.loads(x) for x in (tmp_path / "slurm" / "metrics.jsonl").read_text().splitlines()]
    reference = train(1, [*sets[:-2], "trainer.run.name=one", "trainer.schedule.total_steps=4"]).records
    assert len(records) == 4
    for ours, theirs in zip(records, reference, strict=True):
        assert abs(ours["loss"] - theirs["loss"]) <= 1e-5 * abs(theirs["loss"]), (ours, theirs)
