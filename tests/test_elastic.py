"""One config on any world: a `mesh:` degree of `auto` takes the processes the launch hands the job,
and a run resumed on another world (as torchrun's elastic agent restarts it after a node left) logs the
old and new world once and ends with the weights of an uninterrupted one-process run. With
expert_parallel, auto leaves it out of the count (an MoE on 2 auto ranks with ep 2 trains like one
process), and a world it cannot divide is refused in one line on every rank."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, MOE, NO_CLIP, SGD, TINY, build_error, compare_runs, exported_weights, train

from d9d.ckpt import list_checkpoints
from d9d.mesh.testing import run_distributed
from d9d.trainer import load_job_config


def _args(save_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [*TINY, *SGD, *NO_CLIP, f"trainer.checkpointing.save_dir={save_dir}", f"trainer.run.name={name}",
            f"trainer.schedule.total_steps={steps}", f"export.dir={save_dir / ('export-' + name)}", *extra]  # fmt: skip


def test_an_auto_degree_run_resumed_on_one_process_equals_an_uninterrupted_run(tmp_path):
    reference = train(1, _args(tmp_path, "ref", 8))
    # 4 steps on 2 processes: auto makes them 2 FSDP shards
    first = train(2, _args(tmp_path, "elastic", 4, "mesh.data_parallel_shard=auto"))
    assert len(first.records) == 4
    for a, b in zip(first.records, reference.records[:4], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    # the same config (still auto) on one plain process, to step 8, as `d9d train` runs it
    sets = [
        arg for s in _args(tmp_path, "elastic", 8, "mesh.data_parallel_shard=auto") for arg in ("--set", s)
    ]
    done = subprocess.run([sys.executable, "-m", "d9d.cli", "train", CONFIG, *sets], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "resumed on another world" in line]
    assert len(lines) == 1, done.stdout
    for fragment in ("checkpoint_world=2", "checkpoint_mesh=data_parallel_shard=2", "world=1",
                     "mesh='all degrees 1'"):  # fmt: skip
        assert fragment in lines[0], lines[0]
    changed = [line for line in done.stdout.splitlines() if "resumed with a changed setting" in line]
    assert not [line for line in changed if "key=mesh" in line], (
        changed
    )  # the mesh did not change: auto is auto
    ours, theirs = exported_weights(tmp_path / "export-elastic"), exported_weights(tmp_path / "export-ref")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        # relative to the tensor's largest entry (measured: at most 2.7e-6, lm_head): FSDP's reduction
        # order for the first 4 steps is another float32 summation than one process's
        gap = (ours[name] - tensor).abs().max() / tensor.abs().max().clamp_min(1e-12)
        assert gap <= 1e-5, (name, gap.item())


def test_plan_resolves_auto_for_the_launch_it_is_asked_about():
    sets = ["--set", "mesh.data_parallel_shard=auto", "--set", "mesh.tensor_parallel=2"]
    done = subprocess.run([sys.executable, "-m", "d9d.cli", "plan", CONFIG, "--world-size", "4", *sets],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mesh: data_parallel_shard=2, tensor_parallel=2 → world size 4" in done.stdout
    odd = subprocess.run([sys.executable, "-m", "d9d.cli", "plan", CONFIG, "--world-size", "3", *sets],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)  # fmt: skip
    assert odd.returncode == 2 and odd.stderr.count("\n") == 1, odd.stderr
    assert (
        "auto needs a world of a multiple of 2 processes (the product of the other degrees), but 3"
        in odd.stderr
    )


def test_auto_with_expert_parallel_fills_the_world_and_trains_an_moe_like_one_process(tmp_path):
    auto = ["mesh.data_parallel_shard=auto", "mesh.expert_parallel=2"]
    # expert_parallel regroups the ranks auto counts and adds none: 4 processes are 4 FSDP shards
    mesh = load_job_config(CONFIG, [*MOE, *auto], world_size=4).config.mesh
    assert (mesh.data_parallel_shard, mesh.expert_parallel, mesh.world_size) == (4, 2, 4)
    reference = train(1, _args(tmp_path, "ref", 2, *MOE))
    ran = train(2, _args(tmp_path, "auto-ep", 2, *MOE, *auto))  # each rank resolves auto from WORLD_SIZE
    assert [c.meta.mesh for c in list_checkpoints(tmp_path / "auto-ep")][-1] == {
        "pipeline_parallel": 1, "data_parallel_replicate": 1, "data_parallel_shard": 2,
        "context_parallel": 1, "tensor_parallel": 1, "expert_parallel": 2,
    }  # fmt: skip
    compare_runs(ran, reference, rel=1e-5)


def test_auto_with_an_expert_parallel_the_world_cannot_fit_is_one_line_on_every_rank(tmp_path):
    args = _args(tmp_path, "no-fit", 2, *MOE, "mesh.data_parallel_shard=auto", "mesh.expert_parallel=4")
    assert (
        run_distributed(build_error, 2, args)
        == [
            f"ConfigError: {CONFIG}: mesh.data_parallel_shard: auto is 2 on 2 processes, so a pipeline stage "
            "holds 2 ranks, which mesh.expert_parallel=4 does not divide; launch a multiple of 4 processes or "
            "set mesh.expert_parallel to one of [1, 2]"
        ]
        * 2
    )
    assert not (tmp_path / "no-fit").exists()  # nothing written
