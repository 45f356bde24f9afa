"""Context parallelism through the trainer with the quickstart model: every composition equals one
process; a cp checkpoint resumes on another cp and dp; bad setups fail with one clear line.

Ranks are forked from this process (`_quickstart.train`); one test goes through a real torchrun.
SGD without clipping (fp32): what the update does with the gradient shows in the loss and weights.
Measured spread against one process (3 steps): loss <= 4e-8, grad norm <= 3.4e-7, weights <= 1.3e-7
for every mesh below; REL is 1e-5 as the issue asks.
"""

import shutil
from pathlib import Path

import pytest
from _quickstart import CONFIG, MOE, NO_CLIP, SGD, TRAIN, build_error, compare_runs, overrides, records, train

from d9d.mesh.testing import run_distributed, run_torchrun

REL = 1e-5
STEPS = 3
CP2 = ["mesh.context_parallel=2"]

MESHES = {
    "cp2": (2, CP2),
    "cp4": (4, ["mesh.context_parallel=4"]),
    "cp2-fsdp2": (4, [*CP2, "mesh.data_parallel_shard=2"]),
    "cp2-hsdp": (4, [*CP2, "mesh.data_parallel_replicate=2"]),
    "cp2-tp2": (4, [*CP2, "mesh.tensor_parallel=2"]),
    "cp2-pp2": (4, [*CP2, "mesh.pipeline_parallel=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-reference")
    return train(1, overrides(tmp, "one", STEPS, *SGD, *NO_CLIP))


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-moe-reference")
    return train(1, overrides(tmp, "one", STEPS, *SGD, *NO_CLIP, *MOE))


@pytest.mark.parametrize("name", list(MESHES))
def test_context_parallel_equals_one_process(tmp_path, reference, name):
    nproc, mesh = MESHES[name]
    got = train(nproc, overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, *mesh))
    compare_runs(got, reference, rel=REL)


def test_context_parallel_with_expert_parallel_on_the_moe_variant_equals_one_process(tmp_path, moe_reference):
    got = train(
        2, overrides(tmp_path, "cp2-ep2", STEPS, *SGD, *NO_CLIP, *MOE, *CP2, "mesh.expert_parallel=2")
    )
    compare_runs(got, moe_reference, rel=REL)


def test_a_cp2_checkpoint_resumes_on_cp1_cp4_and_fsdp2_exactly(tmp_path):
    """Saved at step 2 on cp 2; continued to step 4 on one process, on cp 4 and on FSDP 2 (no cp):
    the continued steps and final weights equal an uninterrupted one-process run."""
    expected = train(1, overrides(tmp_path, "reference", 4, *SGD, *NO_CLIP))
    train(2, overrides(tmp_path, "cp2", 2, *SGD, *NO_CLIP, *CP2))
    before = (tmp_path / "cp2" / "metrics.jsonl").read_text().splitlines()
    for name, nproc, mesh in (
        ("on-cp1", 1, []),
        ("on-cp4", 4, ["mesh.context_parallel=4"]),
        ("on-fsdp2", 2, ["mesh.data_parallel_shard=2"]),
    ):
        shutil.copytree(tmp_path / "cp2", tmp_path / name)
        resumed = train(nproc, overrides(tmp_path, name, 4, *SGD, *NO_CLIP, *mesh))
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert lines[:2] == before, f"{name} did not resume from step 2"
        compare_runs(resumed, expected, rel=REL, steps=range(3, 5))
        compare_runs(resumed, expected, rel=REL)


@pytest.mark.slow
def test_python_train_py_under_torchrun_with_context_parallel_2_just_works(tmp_path):
    args = overrides(tmp_path, "torchrun-cp2", 2, *CP2)
    result = run_torchrun([TRAIN, CONFIG, *args], nproc_per_node=2, timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    assert [r["step"] for r in records(tmp_path / "torchrun-cp2")] == [1, 2]
    assert "context_parallel=2" in result.output  # the job built line names the mesh


# ------------------------------------------------------------------------------------------ errors

_NO_CP_PROVIDER = '''
import sys
sys.path.insert(0, {quickstart!r})
from train import QuickstartModelProvider
from d9d.parallel import parallelize_hsdp


class NoContextParallel(QuickstartModelProvider):
    """The quickstart model without parallelize_context_parallel: its attention never gets the group."""

    def parallelize_model_stage(self, context):
        parallelize_hsdp(context.model, context.mesh, blocks=list(context.model.model.layers.values()))
'''


def _errors(tmp_path: Path, *extra: str) -> list[str]:
    return run_distributed(build_error, 2, overrides(tmp_path, "refused", 2, *CP2, *extra))


def test_a_sequence_length_that_cp_cannot_cut_is_one_clear_error_before_anything_is_written(tmp_path):
    errors = _errors(tmp_path, "dataset.seq_len=30")
    assert len(set(errors)) == 1, errors
    assert (
        "the dataset's sequences have 30 tokens, not divisible by 2 × mesh.context_parallel = 4" in errors[0]
    )
    assert "dataset.seq_len" in errors[0]
    assert not (tmp_path / "refused").exists()


def test_a_model_provider_without_context_parallel_support_is_refused_with_the_fix(tmp_path):
    provider = tmp_path / "no_cp.py"
    provider.write_text(_NO_CP_PROVIDER.format(quickstart=str(Path(TRAIN).parent)), encoding="utf-8")
    errors = _errors(tmp_path, f"providers.model={provider}:NoContextParallel")
    assert len(set(errors)) == 1, errors
    assert (
        "mesh.context_parallel=2 but the model provider's parallelize_model_stage gave no module" in errors[0]
    )
    assert "d9d.parallel.parallelize_context_parallel(model, context.mesh)" in errors[0]
    assert not (tmp_path / "refused").exists()
