"""`d9d plan`'s verdict as an exit status (0 fits, 3 does not, 2 refused) and its launch line: a world
size is spread over nodes of `--gpus-per-node` GPUs (8 by default), one node when it fits on one."""

import shlex
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import write_job

from d9d.cli import cli
from d9d.cli.commands._launch import DEFAULT_GPUS_PER_NODE, launch_command
from d9d.cli.commands.init import d9d_invocation
from d9d.cli.commands.plan import EXIT_DOES_NOT_FIT

#: Samples enough for 64 data-parallel ranks of one sample each.
BATCH = ["data.global_batch_size=64", "data.microbatch_size=1"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_job(tmp_path_factory.mktemp("plan_launch"))


def _sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _launch(output: str) -> tuple[str, str]:
    """The `launch (...)` heading and the command under it."""
    lines = output.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("launch (")]
    return lines[at], lines[at + 1].strip()


@pytest.mark.parametrize("world", [1, 8, 64])
def test_a_world_size_is_launched_on_nodes_of_8_gpus(runner, config, world):
    overrides = [f"mesh.data_parallel_shard={world}", *BATCH]
    result = runner.invoke(cli, ["plan", str(config), "--world-size", str(world), *_sets(overrides)])
    assert result.exit_code == 0, result.output
    per_node = min(world, DEFAULT_GPUS_PER_NODE)
    nodes = world // per_node
    heading, command = _launch(result.output)
    assert heading == f"launch ({nodes} node{'s' * (nodes > 1)} × {per_node} process{'es' * (per_node > 1)}):"
    expected = launch_command(
        str(config), overrides, nnodes=nodes, nproc_per_node=per_node, d9d=d9d_invocation()
    )
    assert command == (f"on every node: {expected}" if nodes > 1 else expected)
    words = shlex.split(expected)
    if world > 1:  # torchrun starts every process of the world: nodes × processes per node
        nnodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
        assert nnodes * int(words[words.index("--nproc-per-node") + 1]) == world
        assert ("--nnodes" in words) == (world > DEFAULT_GPUS_PER_NODE)


def test_gpus_per_node_and_the_meshs_own_size_set_the_nodes(runner, config):
    overrides = ["mesh.data_parallel_shard=64", *BATCH]
    four = runner.invoke(
        cli, ["plan", str(config), "--world-size", "64", "--gpus-per-node", "4", *_sets(overrides)]
    )
    assert four.exit_code == 0, four.output
    assert "--nnodes 16 --nproc-per-node 4" in _launch(four.output)[1]
    mesh_size = runner.invoke(
        cli, ["plan", str(config), "--set", "mesh.data_parallel_shard=16", *_sets(BATCH)]
    )
    assert mesh_size.exit_code == 0, mesh_size.output
    assert "--nnodes 2 --nproc-per-node 8" in _launch(mesh_size.output)[1]
    slurm = runner.invoke(
        cli, ["plan", str(config), "--world-size", "64", *_sets(overrides), "--launcher", "slurm"]
    )
    assert slurm.exit_code == 0, slurm.output
    assert "#SBATCH --nodes=8" in slurm.output and "#SBATCH --gpus-per-node=8" in slurm.output


def test_a_world_that_does_not_fill_its_nodes_is_refused_with_a_shape_that_does(runner, config):
    overrides = _sets(["mesh.data_parallel_shard=12", "data.global_batch_size=12", "data.microbatch_size=1"])
    result = runner.invoke(cli, ["plan", str(config), "--world-size", "12", *overrides])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --world-size gives 12 processes, which do not fill nodes of 8 GPUs")
    fix = line[line.index("--nnodes") :].split(",")[0]  # the shape the error proposes, as arguments
    assert fix == "--nnodes 2 --nproc-per-node 6"
    followed = runner.invoke(cli, ["plan", str(config), *fix.split(), *overrides])
    assert followed.exit_code == 0, followed.output
    assert _launch(followed.output)[0] == "launch (2 nodes × 6 processes):"


def test_gpus_per_node_with_nproc_per_node_is_a_usage_error(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--nproc-per-node", "2", "--gpus-per-node", "4"])
    assert result.exit_code == 2 and "--gpus-per-node" in result.stderr


def test_the_exit_status_says_whether_the_job_fits(runner, config):
    """0 when it fits, 3 when it does not (the plan and its levers printed in full, no error), 0 when
    no device size is known."""
    fits = runner.invoke(cli, ["plan", str(config), "--device-memory", "1GiB"])
    assert fits.exit_code == 0 and fits.stdout.count("\nfits: ") == 1, fits.output
    too_big = runner.invoke(cli, ["plan", str(config), "--device-memory", "1KiB"])
    assert too_big.exit_code == EXIT_DOES_NOT_FIT == 3, too_big.output
    assert "\ndoes not fit: " in too_big.stdout and too_big.stderr == ""
    assert too_big.stdout.splitlines()[-2].startswith("launch (")  # the whole plan, then the status
    unknown = runner.invoke(cli, ["plan", str(config)])
    assert unknown.exit_code == 0, unknown.output  # the tiny job fits a local GPU, if there is one
    if not torch.cuda.is_available():
        assert "\nfit: pass --device-memory" in unknown.stdout
