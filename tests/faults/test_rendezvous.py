"""A rank launched with a torchrun-style environment but no reachable store: one line, exit 2, nothing written."""

import os
import subprocess
import sys

from _quickstart import CONFIG, TRAIN, overrides

from d9d.mesh.testing import free_port


def test_an_unreachable_rendezvous_store_is_one_error_naming_the_address(tmp_path):
    port = free_port()  # nothing listens there
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    args = overrides(tmp_path, "nostore", 2, "mesh.data_parallel_shard=2", "trainer.timeouts.init_s=2")
    done = subprocess.run(
        [sys.executable, TRAIN, CONFIG, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(
        f"error: rank 1 could not reach the rendezvous store at 127.0.0.1:{port} within 2 s"
    )
    assert "MASTER_ADDR/MASTER_PORT" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "nostore").exists()
