"""`d9d plan`: layout, microbatches, memory estimate and launch command; every way it refuses."""

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli_concurrently, write_job

from d9d.cli import cli
from d9d.cli.commands._text import format_size
from d9d.cli.commands.plan import estimate_memory, launch_command
from d9d.mesh import MeshConfig, axis_groups


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_job(tmp_path_factory.mktemp("plan"))


def _lines(output: str, prefix: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.strip().startswith(prefix)]


def test_estimate_divides_by_the_sharding_degrees():
    est = estimate_memory(
        8000, 6000, pipeline_parallel=2, data_parallel_shard=2, tensor_parallel=2, optimizer_states=2
    )
    assert est.shard_factor == 8
    assert (est.params, est.grads, est.optimizer) == (1000, 750, 1500)
    assert est.total == 1000 + 750 + 1500


def test_estimate_rounds_up_and_sgd_without_momentum_has_no_state():
    est = estimate_memory(
        10, 10, pipeline_parallel=1, data_parallel_shard=3, tensor_parallel=1, optimizer_states=0
    )
    assert (est.params, est.grads, est.optimizer) == (4, 4, 0)


def test_launch_command_for_one_process_many_processes_and_many_nodes():
    assert launch_command("c.yaml", [], nnodes=1, nproc_per_node=1) == "d9d train c.yaml"
    one_node = launch_command("my c.yaml", ["a.b=1"], nnodes=1, nproc_per_node=4)
    assert shlex.split(one_node) == [
        "torchrun", "--nproc-per-node", "4", "-m", "d9d.cli", "train", "my c.yaml", "--set", "a.b=1",
    ]  # fmt: skip
    nodes = shlex.split(launch_command("c.yaml", [], nnodes=2, nproc_per_node=8))
    assert nodes[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert "--rdzv-endpoint" in nodes and nodes[-3:] == ["d9d.cli", "train", "c.yaml"]


def test_plan_prints_layout_batches_memory_and_command(runner, config):
    sets = ["--set", "mesh.data_parallel_shard=2", "--set", "mesh.tensor_parallel=2"]
    result = runner.invoke(cli, ["plan", str(config), "--world-size", "4", *sets])
    assert result.exit_code == 0, result.output
    out = result.output
    mesh = MeshConfig(data_parallel_shard=2, tensor_parallel=2)
    tp_groups = axis_groups(mesh, "dense", "tp")
    assert f"[{tp_groups[0][0]},{tp_groups[0][1]}]" in out
    # data: 8 samples over 2 DP ranks in microbatches of 2 → 2 microbatches per rank
    assert _lines(out, "data:") == [
        "data: global batch 8 = 2 data-parallel ranks × 2 microbatches of 2 per step"
    ]
    # TinyLM(vocab 32, hidden 16, 2 layers): embed 32·16 + 2·(16·16+16) + head 16·32
    n_params = 32 * 16 + 2 * (16 * 16 + 16) + 16 * 32
    assert f"{n_params:,} parameters" in out
    per_rank = estimate_memory(
        n_params * 4,
        n_params * 4,
        pipeline_parallel=1,
        data_parallel_shard=2,
        tensor_parallel=2,
        optimizer_states=2,
    )
    assert "1/4 of the model" in out
    command = _lines(out, "torchrun")
    assert command == [launch_command(str(config), sets[1::2], nnodes=1, nproc_per_node=4)]
    assert _lines(out, "parameters")[0].split(None, 1)[1] == format_size(per_rank.params)
    assert _lines(out, "total")[0].split(None, 1)[1] == format_size(per_rank.total)


def test_plan_without_a_size_plans_for_the_mesh(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--set", "mesh.data_parallel_replicate=2"])
    assert result.exit_code == 0, result.output
    assert _lines(result.output, "torchrun") == [
        launch_command(str(config), ["mesh.data_parallel_replicate=2"], nnodes=1, nproc_per_node=2)
    ]


def test_plan_for_several_nodes(runner, config):
    args = [
        "plan",
        str(config),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--set",
        "mesh.data_parallel_shard=4",
    ]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "2 nodes × 2 processes" in result.output
    assert "--nnodes 2 --nproc-per-node 2" in result.output


def test_mismatched_world_size_is_one_line(runner, config):
    result = runner.invoke(
        cli, ["plan", str(config), "--world-size", "8", "--set", "mesh.data_parallel_shard=2"]
    )
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "8" in lines[0] and "needs 2" in lines[0] and "mesh.data_parallel_shard=8" in lines[0]


def test_mismatched_nodes_name_both_numbers(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--nnodes", "2", "--nproc-per-node", "3"])
    assert result.exit_code == 2
    assert "--nnodes 2 × --nproc-per-node 3 gives 6 processes" in result.stderr


@pytest.mark.parametrize(
    "args",
    [["--world-size", "2", "--nnodes", "2"], ["--nnodes", "2"]],
    ids=["size-and-nodes", "nodes-alone"],
)
def test_conflicting_size_options_are_usage_errors(runner, config, args):
    result = runner.invoke(cli, ["plan", str(config), *args])
    assert result.exit_code == 2
    assert "--nnodes" in result.stderr


def test_batch_that_does_not_divide_is_one_line(runner, config):
    result = runner.invoke(cli, ["plan", str(config), "--set", "mesh.data_parallel_shard=3"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: data.global_batch_size=8")
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_config_and_bad_path(runner, config, tmp_path):
    bad_key = runner.invoke(cli, ["plan", str(config), "--set", "trainer.bogus=1"])
    assert bad_key.exit_code == 2 and "unknown key trainer.bogus" in bad_key.stderr
    missing = runner.invoke(cli, ["plan", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such config file" in missing.stderr
    bad_provider = runner.invoke(cli, ["plan", str(config), "--set", "providers.model=tiny_job.py:Nope"])
    assert bad_provider.exit_code == 2 and "Nope" in bad_provider.stderr
    bad_type = runner.invoke(cli, ["plan", str(config), "--set", "data.global_batch_size=abc"])
    assert bad_type.exit_code == 2 and "data.global_batch_size: Expected int" in bad_type.stderr
    assert "Traceback" not in bad_key.output + missing.output + bad_provider.output + bad_type.output


def test_debug_shows_the_exception(runner, config):
    result = runner.invoke(cli, ["--debug", "plan", str(config), "--world-size", "3"])
    assert result.exit_code != 0
    assert type(result.exception).__name__ == "CliError"


def test_plan_in_a_subprocess(config, tmp_path):
    ok, bad, missing = run_cli_concurrently(
        ["plan", str(config), "--world-size", "2", "--set", "mesh.data_parallel_shard=2"],
        ["plan", str(config), "--world-size", "3"],
        ["plan", str(tmp_path / "nope.yaml")],
    )
    assert ok.returncode == 0, ok.stderr
    assert "torchrun --nproc-per-node 2 -m d9d.cli train" in ok.stdout
    assert (
        missing.returncode == 2
        and missing.stderr.startswith("error: ")
        and "no such config" in missing.stderr
    )
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --world-size gives 3 processes")
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_plan_shows_precision_checkpointing_and_activations_with_and_without_it(runner, config):
    base = ["plan", str(config), "--seq-len", "64"]
    result = runner.invoke(cli, [*base, "--set", "trainer.activation_checkpointing.mode=full"])
    assert result.exit_code == 0, result.output
    out = result.output
    (precision,) = _lines(out, "precision:")
    assert "compute bfloat16 (auto: bfloat16 on CUDA, float32 on CPU), reduce float32" in precision
    (ac,) = _lines(out, "activation checkpointing:")
    assert ac.startswith("activation checkpointing: full")
    (acts,) = _lines(out, "activations")
    assert "one microbatch of 2 × 64 tokens in bfloat16, checkpointing full" in acts
    fp32 = runner.invoke(cli, [*base, "--set", "trainer.precision.param_dtype=float32"])
    assert "in float32, checkpointing none" in _lines(fp32.output, "activations")[0]
    (total,) = _lines(out, "total")
    assert total.split()[1:] != _lines(fp32.output, "total")[0].split()[1:]  # activations count in the total


def test_plan_without_a_sequence_length_says_how_to_get_the_activation_estimate(runner, config):
    result = runner.invoke(cli, ["plan", str(config)])
    assert result.exit_code == 0, result.output
    (acts,) = _lines(result.output, "activations")
    assert "pass --seq-len" in acts
