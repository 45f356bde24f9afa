"""How many processes a launch started, and whether the mesh fits them (`check_launch`).

Read from torchrun's environment (or an existing process group), without importing torch: a job whose
mesh does not fit its launch fails before anything heavy is imported. `DistributedContext.from_env`
runs the same check.
"""

import sys
from collections.abc import Mapping

from d9d.mesh.config import MeshConfig
from d9d.mesh.errors import LaunchError

__all__ = ["TORCHRUN_VARS", "check_launch", "launched_world_size", "mismatch_message"]

#: The variables torchrun sets for every process it starts.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_world_size(env: Mapping[str, str]) -> tuple[int, str]:
    """How many processes were launched, and by what (for the error message).

    Raises:
        LaunchError: the environment sets some of torchrun's variables but not all, or a WORLD_SIZE
            that is not an integer.
    """
    dist = sys.modules.get("torch.distributed")  # not imported: no process group can exist
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), "the existing process group"
    present = [v for v in TORCHRUN_VARS if v in env]
    if not present:
        return 1, "plain python (no torchrun)"
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise LaunchError(
            f"the launch environment sets {present} but not {missing}; start the job with torchrun "
            f"(or unset {present} to run it as one plain process)"
        )
    try:
        world = int(env["WORLD_SIZE"])
    except ValueError:
        raise LaunchError(
            f"WORLD_SIZE={env['WORLD_SIZE']!r} is not an integer; start the job with torchrun"
        ) from None
    return world, "torchrun"


def check_launch(config: MeshConfig, env: Mapping[str, str]) -> tuple[int, str]:
    """The launch's (process count, launcher) when it is `config.world_size`.

    Raises:
        LaunchError: the process count is not the mesh's, naming both and how to launch instead.
    """
    launched, launched_by = launched_world_size(env)
    if launched != config.world_size:
        raise LaunchError(mismatch_message(config, launched, launched_by, env))
    return launched, launched_by


def mismatch_message(config: MeshConfig, launched: int, launched_by: str, env: Mapping[str, str]) -> str:
    """Why `launched` processes (started by `launched_by`) do not fit `config`, and how to launch instead."""
    need = config.world_size
    what = f"the mesh ({config.describe_degrees()}) needs {need} process{'es' if need != 1 else ''}"
    got = f"{launched_by} started {launched}"
    if need == 1:
        fix = (
            "run it as one plain process (`python train.py config.yaml`) "
            "or raise the mesh degrees so that their product equals the process count"
        )
    else:
        per_node = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
        launch = f"`torchrun --nproc-per-node {need} ...` on one node"
        if per_node > 1 and need % per_node == 0 and need // per_node > 1:
            launch += f" or `torchrun --nnodes {need // per_node} --nproc-per-node {per_node} ...`"
        else:
            launch += f" or `--nnodes N --nproc-per-node M` with N × M = {need}"
        fix = f"launch with {launch}, or change the mesh so that its product is {launched}"
    return f"{what}, but {got}; {fix}"
