"""The reference model's degrees are checked against its shape before anything is written: by
`d9d plan` (one process, any size) and by the job itself (real gloo ranks)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, MOE, overrides, run_forked

from d9d.mesh.testing import DistributedTestError, run_distributed
from d9d.trainer import Trainer

CASES = {
    "tp2-one-kv-head": (
        ["mesh.tensor_parallel=2", "model.num_key_value_heads=1"],
        "model.num_key_value_heads=1 is not divisible by mesh.tensor_parallel=2",
    ),
    "ep4-six-experts": (
        [
            "mesh.data_parallel_shard=4",
            "mesh.expert_parallel=4",
            "model.moe={num_experts: 6, top_k: 2, moe_intermediate_size: 32}",
        ],
        "model.moe.num_experts=6 is not divisible by mesh.expert_parallel=4",
    ),
    "pp4-two-layers": (
        ["mesh.pipeline_parallel=4"],
        "mesh.pipeline_parallel=4 is more than model.num_layers=2",
    ),
    "ep2-dense-model": (["mesh.data_parallel_shard=2", "mesh.expert_parallel=2"], "the model has no experts"),
    "tp2-moe-model": (["mesh.tensor_parallel=2", *MOE], "mesh.tensor_parallel=2 with MoE layers (model.moe)"),
}


def _plan(args: list[str]) -> tuple[int | None, str, str]:
    """`d9d plan CONFIG ARGS` (click's runner, in a forked process): its exit code, what the command
    raised other than its exit (a traceback's exception), and its stderr."""
    from click.testing import CliRunner

    from d9d.cli import cli

    result = CliRunner().invoke(cli, ["plan", CONFIG, *args])
    escaped = "" if isinstance(result.exception, SystemExit) else repr(result.exception)
    return result.exit_code, escaped, result.stderr


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_plan_refuses_degrees_the_model_cannot_split(tmp_path, case):
    sets, expected = CASES[case]
    args = [a for item in overrides(tmp_path, "plan", 2, *sets) for a in ("--set", item)]
    code, escaped, stderr = run_forked(_plan, args, timeout=120)  # a fork: no interpreter start-up
    assert code != 0
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], stderr
    assert not escaped and "Traceback" not in stderr, escaped  # reported, not raised


def _build(args: list[str]) -> None:
    with Trainer.from_config(CONFIG, args):
        pass


def test_the_job_refuses_them_on_its_ranks_before_writing(tmp_path):
    sets, expected = CASES["tp2-one-kv-head"]
    with pytest.raises(DistributedTestError) as failure:
        run_distributed(_build, 2, overrides(tmp_path, "tp", 2, *sets), timeout=120)
    assert expected in str(failure.value)
    assert not (tmp_path / "tp").exists()


def test_a_moe_model_accepts_a_dividing_expert_degree(tmp_path):
    run_distributed(
        _build,
        2,
        overrides(tmp_path, "ep", 2, "mesh.data_parallel_shard=2", "mesh.expert_parallel=2", *MOE),
        timeout=120,
    )
