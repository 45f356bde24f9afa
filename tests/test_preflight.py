"""`d9d preflight` under the job's launch: a rank slowed on purpose (it sleeps before every timed
collective) is named from the groups it slows on each mesh axis, and a healthy launch of the same
mesh passes; a rank launched from another copy of the job (another provider file, another override,
another save_dir) fails the code, config and shared-save_dir checks by name; a rendezvous that never
completes is one line. Nothing is left on disk."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, ROOT, TINY

from d9d.mesh.testing import free_port, run_distributed

MESH = ["mesh.data_parallel_shard=2", "mesh.tensor_parallel=2"]


def _preflight_rank(sets: list[str], threshold: float) -> list[str] | None:
    from d9d.trainer import load_job_config
    from d9d.trainer.planning.preflight import format_preflight, run_preflight

    report = run_preflight(load_job_config(CONFIG, sets), nbytes=2**20, iters=7, threshold=threshold)
    return format_preflight(report) if os.environ["RANK"] == "0" else None


def _check(lines: list[str], name: str) -> str:
    (line,) = [x for x in lines if x[8:].startswith(f"{name} ")]
    return line


def test_a_slowed_rank_is_named_and_the_same_mesh_unslowed_passes(tmp_path):
    sets = [*TINY, *MESH, f"trainer.checkpointing.save_dir={tmp_path / 'runs'}"]
    slowed = {"OMP_NUM_THREADS": "1", "D9D_TEST_SLOW_RANK": "3", "D9D_TEST_SLOW_COLLECTIVES_S": "0.05"}
    lines = run_distributed(_preflight_rank, 4, sets, 0.25, env=slowed, timeout=120)[0]
    assert lines[0] == "preflight: 4 ranks on 1 node, mesh data_parallel_shard=2, tensor_parallel=2, cpu"
    # rank 3 is in dp_shard group (1, 3) and tp group (2, 3): each is slow, and only rank 3 is in both
    assert _check(lines, "bandwidth dp_shard").startswith("  FAIL  bandwidth dp_shard  slow group 1, 3 ")
    assert (
        _check(lines, "bandwidth tp").startswith("  FAIL  bandwidth tp  ") and "slow group 2, 3 " in lines[6]
    )
    assert "FAIL  slow ranks" in _check(lines, "slow ranks") and " rank 3 (" in _check(lines, "slow ranks")
    for name in ("same code", "same config", "save_dir shared", "save_dir room"):
        assert _check(lines, name).startswith("  ok    "), lines
    assert lines[-1] == "3 checks failed"
    # the same launch without the slow rank: a generous threshold keeps a loaded machine's noise out (the
    # suite's other worker shares the 2 cores with these 4 ranks; the slowed rank above falls far below)
    healthy = run_distributed(_preflight_rank, 4, sets, 0.85, env={"OMP_NUM_THREADS": "1"}, timeout=120)[0]
    assert healthy[-1] == "all checks passed", healthy
    assert [x.split()[0] for x in healthy[1:-1]] == ["ok"] * 7, healthy
    assert list(tmp_path.iterdir()) == []  # the probes are gone; save_dir was never created


def _copy_job(where: Path, comment: str = "") -> Path:
    (where / "quickstart").mkdir(parents=True)
    shutil.copytree(ROOT / "examples" / "data", where / "data")
    for name in ("config.yaml", "train.py"):
        shutil.copy(ROOT / "examples" / "quickstart" / name, where / "quickstart" / name)
    config = where / "quickstart" / "config.yaml"  # the job's own module: train.py (its provider names)
    config.write_text(
        config.read_text().replace("d9d.trainer:ReferenceModelProvider", "train.py:QuickstartModelProvider")
    )
    if comment:
        train = where / "quickstart" / "train.py"
        train.write_text(train.read_text() + comment)
    return where / "quickstart" / "config.yaml"


@pytest.mark.slow
def test_a_rank_with_other_code_config_and_save_dir_is_named_with_exit_status_1(tmp_path):
    configs = [_copy_job(tmp_path / "a"), _copy_job(tmp_path / "b", comment="# edited on one node\n")]
    port = free_port()
    procs = []
    for rank, config in enumerate(configs):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        sets = [*TINY, "mesh.data_parallel_shard=2", *(["optimizer.lr=0.01"] if rank else [])]
        args = [a for s in sets for a in ("--set", s)]
        procs.append(subprocess.Popen([sys.executable, "-m", "d9d.cli", "preflight", str(config), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    (out0, err0), (out1, _) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 1 and procs[1].returncode == 0, err0
    assert out1 == ""  # rank 0 alone prints the table
    lines = out0.splitlines()
    assert _check(lines, "same code").startswith("  FAIL  same code  ") and "rank 1 (" in lines[1]
    assert "install the same d9d, torch and job files on every node" in lines[1]
    assert _check(lines, "same config").startswith("  FAIL  same config  ") and "rank 1 (" in lines[2]
    shared = _check(lines, "save_dir shared")
    assert (
        shared.startswith("  FAIL  ")
        and "rank 1 (" in shared
        and "and rank 0 do not see each other's files" in shared
    )
    assert "set trainer.checkpointing.save_dir to a shared path" in shared
    assert _check(lines, "bandwidth dp_shard").startswith("  ok    ")  # one group: nothing to compare
    for job in ("a", "b"):  # no probe, no run directory
        assert sorted(p.name for p in (tmp_path / job / "quickstart").iterdir()) == [
            "config.yaml",
            "train.py",
        ]


@pytest.mark.slow
def test_the_command_under_torchrun_names_the_slow_rank_and_a_rendezvous_that_never_completes_is_one_line(
    tmp_path,
):
    sets = [*TINY, *MESH, f"trainer.checkpointing.save_dir={tmp_path}"]
    args = [a for s in sets for a in ("--set", s)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "D9D_TEST_SLOW_RANK": "2",
        "D9D_TEST_SLOW_COLLECTIVES_S": "0.05",
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                str(free_port()), "-m", "d9d.cli", "preflight", CONFIG, *args]  # fmt: skip
    done = subprocess.run(torchrun, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("preflight: 4 ranks on 1 node") and lines[-1] == "3 checks failed", done.stdout
    assert " rank 2 (" in _check(lines, "slow ranks")
    assert list(tmp_path.iterdir()) == []
    # rank 0 of two, alone: the rendezvous store waits for rank 1 until trainer.timeouts.init_s
    alone = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port())}  # fmt: skip
    lone = [sys.executable, "-m", "d9d.cli", "preflight", CONFIG, "--set", "mesh.data_parallel_shard=2",
            "--set", "trainer.timeouts.init_s=3", "--set", f"trainer.checkpointing.save_dir={tmp_path}"]  # fmt: skip
    done = subprocess.run(lone, capture_output=True, text=True, env=alone, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "rendezvous" in line, line
    assert list(tmp_path.iterdir()) == []
