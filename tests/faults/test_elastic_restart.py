"""Elastic runs under torchrun's elastic agent, on loopback: two agents (nodes) of one process each
meet at a c10d rendezvous with `--nnodes 1:2` and train one config whose data-parallel degree is
`auto`. A node lost mid-run: the other's step watchdog ends the stuck step, its agent restarts it on
the one remaining node from the latest checkpoint. A node joining: the running agent restarts its
worker (which saves on the agent's SIGTERM) and both continue on two. Either way the final weights
equal an uninterrupted one-process run (fp32, within 1e-5 of each tensor's largest entry)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from _quickstart import CONFIG, NO_CLIP, SGD, TINY, exported_weights, train

from d9d.mesh.testing import free_port

pytestmark = pytest.mark.slow

STEPS = 12


def _sets(root: Path, name: str, *extra: str) -> list[str]:
    # lr 0.1: at SGD's 0.5 float32 reduction-order noise of the 2-process steps grows past 1e-5 by step 12
    return [*TINY, *SGD, "optimizer.lr=0.1", *NO_CLIP, f"trainer.checkpointing.save_dir={root}", f"trainer.run.name={name}",
            f"trainer.schedule.total_steps={STEPS}", "trainer.checkpointing.period_steps=4",
            f"export.dir={root / ('export-' + name)}", *extra]  # fmt: skip


class _Agents:
    """torchrun agents of one elastic job (1 to 2 nodes of one process) on a loopback rendezvous."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.procs = root, free_port(), []
        sets = _sets(root, "elastic", "mesh.data_parallel_shard=auto", "trainer.timeouts.step_s=8")
        self.command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "elastic",
            "--rdzv-conf", "join_timeout=60,last_call_timeout=2,close_timeout=5", "--max-restarts", "3",
            "--monitor-interval", "0.5", "-m", "d9d.cli", "train", CONFIG, *[a for s in sets for a in ("--set", s)],
        ]  # fmt: skip

    def start(self, **env: str) -> subprocess.Popen[str]:
        log = open(self.root / f"agent{len(self.procs)}.log", "w")  # noqa: SIM115 - closed with the process
        # torch 2.15's shared rendezvous store: a node that joins at a later round waits forever for a
        # MASTER_ADDR that the rank-0 agent of earlier rounds never writes again (docs/running-jobs.md)
        env = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
        proc = subprocess.Popen(self.command, env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def wait_for(self, step: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while not (self.root / "elastic" / f"save-{step}" / "commit.json").exists():
            assert time.monotonic() < end, self.logs()
            time.sleep(0.1)

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.root.glob("agent*.log")))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _assert_equal_to_one_process(root: Path) -> None:
    train(1, _sets(root, "ref"))
    ours, theirs = exported_weights(root / "export-elastic"), exported_weights(root / "export-ref")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        gap = (ours[name] - tensor).abs().max() / tensor.abs().max().clamp_min(1e-12)
        assert gap <= 1e-5, (name, gap.item())


def _world_lines(logs: str) -> list[str]:
    return [line for line in logs.splitlines() if "resumed on another world" in line]


def test_a_node_lost_mid_run_restarts_on_the_other_node_and_ends_with_one_process_weights(tmp_path):
    agents = _Agents(tmp_path)
    try:
        first = agents.start()
        time.sleep(1.0)  # the first agent hosts the rendezvous store: the one killed must be the other
        # the second node's rank hangs in step 6 (after the checkpoint of step 4), then the node dies
        lost = agents.start(D9D_TEST_HANG_AT_STEP="6", D9D_TEST_HANG_RANK="any", D9D_TEST_HANG_S="600")
        agents.wait_for(4)
        os.killpg(lost.pid, signal.SIGKILL)
        lost.wait()
        assert first.wait(timeout=240) == 0, agents.logs()
    finally:
        agents.kill()
    logs = agents.logs()
    assert "step 6 did not finish within trainer.timeouts.step_s=8 s" in logs  # the watchdog, not a hang
    (line,) = _world_lines(logs)
    for fragment in ("step=4", "checkpoint_world=2", "checkpoint_mesh=data_parallel_shard=2", "world=1"):
        assert fragment in line, line
    _assert_equal_to_one_process(tmp_path)


def test_a_node_joining_at_a_restart_is_used_and_the_run_ends_with_one_process_weights(tmp_path):
    agents = _Agents(tmp_path)
    try:
        # one node trains alone; in step 6 it stalls long enough for a second node to arrive
        first = agents.start(D9D_TEST_HANG_AT_STEP="6", D9D_TEST_HANG_RANK="any", D9D_TEST_HANG_S="12")
        agents.wait_for(4)
        second = agents.start()
        assert first.wait(timeout=240) == 0, agents.logs()
        assert second.wait(timeout=60) == 0, agents.logs()
    finally:
        agents.kill()
    logs = agents.logs()
    lines = _world_lines(logs)
    assert lines and all("checkpoint_world=1" in x and "world=2" in x for x in lines), logs
    assert "mesh=data_parallel_shard=2" in lines[0]
    _assert_equal_to_one_process(tmp_path)
