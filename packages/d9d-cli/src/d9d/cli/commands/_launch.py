"""How `d9d plan` launches a job: the launch shape asked for, the torchrun command and the sbatch script.

Torch-free: the commands are text, built from the config path, its `--set` overrides and the shape.
"""

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

from d9d.cli.errors import CliError

if TYPE_CHECKING:
    from d9d.mesh import MeshConfig

__all__ = [
    "DEFAULT_GPUS_PER_NODE",
    "check_launch_size",
    "launch_command",
    "launch_shape",
    "nodes_of",
    "slurm_script",
    "with_launch",
]

#: GPUs (processes) per node when the launch is given as a world size (`--gpus-per-node`'s default).
DEFAULT_GPUS_PER_NODE = 8


def launch_shape(
    world_size: int | None, nnodes: int | None, nproc_per_node: int | None, gpus_per_node: int | None = None
) -> tuple[int, int] | None:
    """(nodes, processes per node) asked for on the command line, or None for "what the mesh needs".

    --world-size N is (1, N) here; `check_launch_size` spreads it over nodes of `gpus_per_node`.
    """
    if world_size is not None and (nnodes is not None or nproc_per_node is not None):
        raise click.UsageError("give either --world-size or --nnodes/--nproc-per-node, not both")
    if gpus_per_node is not None and nproc_per_node is not None:
        raise click.UsageError(
            "--gpus-per-node spreads --world-size (or the mesh's size) over nodes; with --nproc-per-node "
            "the processes per node are given: drop one of them"
        )
    if world_size is not None:
        return 1, world_size
    if nnodes is not None and nproc_per_node is None:
        raise click.UsageError("--nnodes needs --nproc-per-node (processes on each node)")
    if nproc_per_node is not None:
        return nnodes or 1, nproc_per_node
    return None


def check_launch_size(
    shape: tuple[int, int] | None,
    mesh: "MeshConfig",
    *,
    by_world_size: bool,
    gpus_per_node: int | None = None,
) -> tuple[int, int]:
    """(nodes, processes per node) of the launch: `shape`, else what the mesh needs; a mismatch is an error.

    `by_world_size` says the shape came from --world-size (not --nnodes/--nproc-per-node), for the error.
    A world size (given or the mesh's) is spread over nodes of `gpus_per_node` (None: 8) by `nodes_of`.
    """
    need = mesh.world_size
    nodes, per_node = shape if shape is not None else (1, need)
    if nodes * per_node != need:
        given = "--world-size" if by_world_size else f"--nnodes {nodes} × --nproc-per-node {per_node}"
        raise _mismatch(mesh.describe_degrees(), need, mesh.data_parallel_shard, nodes * per_node, given)
    if shape is None or by_world_size:
        given = "--world-size" if by_world_size else f"the mesh's size ({mesh.describe_degrees()})"
        return nodes_of(need, gpus_per_node, given)
    return nodes, per_node


def nodes_of(world: int, gpus_per_node: int | None, given: str = "--world-size") -> tuple[int, int]:
    """(nodes, processes per node) for `world` processes on nodes of `gpus_per_node` GPUs (None: 8):
    one node when they fit on one, else world / gpus_per_node full nodes.

    Raises:
        CliError: `world` is more than a node holds and not a multiple of it (`given` says where
            `world` came from); the error names a shape that divides it.
    """
    per_node = gpus_per_node or DEFAULT_GPUS_PER_NODE
    if world <= per_node:
        return 1, world
    if world % per_node == 0:
        return world // per_node, per_node
    fits = max(d for d in range(1, per_node + 1) if world % d == 0)
    default = "" if gpus_per_node else ", the default"
    raise CliError(
        f"{given} gives {world} processes, which do not fill nodes of {per_node} GPUs (--gpus-per-node "
        f"{per_node}{default}): make the world a multiple of {per_node}, or give the nodes instead "
        f"(e.g. --nnodes {world // fits} --nproc-per-node {fits}, or --gpus-per-node {fits})"
    )


def _mismatch(degrees: str, need: int, dp_shard: int, world: int, given: str) -> CliError:
    """The launch gives `world` processes but the mesh needs `need`: say so, with a dp_shard that would fit."""
    others = need // dp_shard  # the product of every other degree
    hint = f" (e.g. --set mesh.data_parallel_shard={world // others})" if world % others == 0 else ""
    return CliError(
        f"{given} gives {world} processes, but the mesh ({degrees}) needs {need}; "
        f"change the mesh degrees so that their product is {world}{hint}, or launch {need} "
        f"process{'es' if need != 1 else ''}"
    )


def with_launch(
    lines: list[str],
    config: str,
    overrides: Sequence[str],
    *,
    launcher: str,
    nnodes: int,
    nproc_per_node: int,
    name: str,
    d9d: str,
) -> list[str]:
    """The plan's `lines` then the launch command, or (`launcher` slurm) an sbatch script with them as comments."""
    if launcher == "slurm":
        script = slurm_script(
            config, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node, name=name, d9d=d9d
        )
        return [
            script[0],
            *script[1:6],
            *(f"# {part}" for line in lines for part in line.splitlines()),
            *script[6:],
        ]
    command = launch_command(config, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node, d9d=d9d)
    where = "on every node: " if nnodes > 1 else ""
    return [
        *lines,
        f"launch ({nnodes} node{'s' if nnodes > 1 else ''} × {nproc_per_node} process{'es' if nproc_per_node > 1 else ''}):",
        f"  {where}{command}",
    ]


def launch_command(
    config: str, overrides: Sequence[str], *, nnodes: int, nproc_per_node: int, d9d: str = "d9d"
) -> str:
    """The shell command that launches `d9d train` for this many nodes and processes per node.

    One process in all runs `d9d train` itself; several go through torchrun (several nodes rendezvous at
    node 0: fill in its host). `d9d` is how the shell runs d9d (`d9d_invocation()`: the bare name
    or this environment's script, e.g. under `uv run`); torchrun is then taken from the same place.
    """
    job = _job_args(config, overrides)
    if nnodes * nproc_per_node == 1:
        return f"{d9d} train {job}"
    torchrun = _torchrun_beside(d9d)
    if nnodes == 1:
        return f"{torchrun} --nproc-per-node {nproc_per_node} -m d9d.cli train {job}"
    return (
        f"{torchrun} --nnodes {nnodes} --nproc-per-node {nproc_per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint HOST_OF_NODE_0:29500 -m d9d.cli train {job}"
    )


def slurm_script(
    config: str, overrides: Sequence[str], *, nnodes: int, nproc_per_node: int, name: str, d9d: str = "d9d"
) -> list[str]:
    """An sbatch script (its lines) that runs the job on `nnodes` Slurm nodes: one task per node, each
    a torchrun agent of `nproc_per_node` processes meeting at a c10d rendezvous on the job's first
    node (port 29500), whose id is the Slurm job id."""
    job = _job_args(config, overrides)
    torchrun = _torchrun_beside(d9d)
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={shlex.quote(name)}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc_per_node}",
        f"#SBATCH --output={shlex.quote(name)}-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun {torchrun} --nnodes "$SLURM_NNODES" --nproc-per-node {nproc_per_node} --rdzv-backend c10d '
        f'--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID" -m d9d.cli train {job}',
    ]


def _job_args(config: str, overrides: Sequence[str]) -> str:
    """`CONFIG --set A --set B ...`, quoted for the shell."""
    args = [config]
    for item in overrides:
        args += ["--set", item]
    return " ".join(shlex.quote(part) for part in args)


def _torchrun_beside(d9d: str) -> str:
    """torchrun of the environment that `d9d` (a `d9d_invocation()` answer) runs from.

    torchrun runs `-m d9d.cli` with its own interpreter, so it must be this environment's: its
    `torchrun` script next to the `d9d` script (torch installs both), or `PYTHON -m
    torch.distributed.run` when d9d runs as `PYTHON -m d9d.cli`.
    """
    if d9d == "d9d":  # this environment's bin directory is on the shell's PATH
        return "torchrun"
    parts = shlex.split(d9d)
    if parts[1:] == ["-m", "d9d.cli"]:
        return f"{shlex.quote(parts[0])} -m torch.distributed.run"
    return shlex.quote(str(Path(parts[0]).with_stem("torchrun")))
