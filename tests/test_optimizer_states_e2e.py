"""Optimizer states in bfloat16 through the trainer (`optimizer.state_dtype: bfloat16`): a run resumes
across the setting both ways, its checkpoint holding the states in the dtype the run kept them in,
and FSDP 2 with bfloat16 states equals one process.

The resumes are compared with uninterrupted runs exactly where exactness follows: a step's loss
comes from the weights before its update, and bfloat16 states are torch's update given the stored
states, so a bfloat16 run resumed with float32 states logs every loss of the uninterrupted bfloat16
run (the first float32 update starts from the bfloat16 states, exactly upcast), and a float32 run
resumed with bfloat16 states logs the uninterrupted float32 run's losses up to the first step after
the resume (whose weights come from the first update from rounded states). The loss drift over 200
quickstart steps and the bytes saved are measured in benchmarks/optimizer_states.py; the plan's
estimate is tested with `d9d plan` (packages/d9d-cli/tests/test_plan.py) and the refusal of a custom
optimizer provider that declares no bfloat16 states is a bad-input case."""

import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import compare_runs, overrides, spread, train

BF16 = ["optimizer.state_dtype=bfloat16"]
STEPS = 4  # a checkpoint at step 2 (the tiny quickstart saves every 2 steps) and at 4


def _state_dtypes(checkpoint: Path) -> set[torch.dtype]:
    """The dtypes of the optimizer's per-parameter states in a checkpoint (from its DCP metadata)."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {
        entry.properties.dtype
        for key, entry in metadata.items()
        if key.startswith("optimizer.state.") and isinstance(entry, TensorStorageMetadata) and entry.size
    }


def _losses(run) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in run.records]


def test_a_run_resumes_across_the_state_dtype_both_ways(tmp_path):
    float32 = train(1, overrides(tmp_path, "f32", STEPS))
    bf16 = train(1, overrides(tmp_path, "bf16", STEPS, *BF16))
    assert _state_dtypes(tmp_path / "f32" / f"save-{STEPS}") == {torch.float32}
    assert _state_dtypes(tmp_path / "bf16" / f"save-{STEPS}") == {torch.bfloat16}

    train(1, overrides(tmp_path, "to_f32", 2, *BF16))  # stopped at its step-2 checkpoint ...
    to_float32 = train(1, overrides(tmp_path, "to_f32", STEPS))  # ... resumed with float32 states
    assert [r["step"] for r in to_float32.records] == list(range(1, STEPS + 1))
    assert _losses(to_float32) == _losses(bf16)
    assert _state_dtypes(tmp_path / "to_f32" / f"save-{STEPS}") == {torch.float32}

    train(1, overrides(tmp_path, "to_bf16", 2))
    to_bf16 = train(1, overrides(tmp_path, "to_bf16", STEPS, *BF16))
    assert _losses(to_bf16)[:3] == _losses(float32)[:3]
    assert _state_dtypes(tmp_path / "to_bf16" / f"save-{STEPS}") == {torch.bfloat16}
    # after that only the states' rounding differs (measured by step 4: losses 1.5e-6, weights 3.1e-4;
    # bfloat16 against float32 states all along: 1.3e-6 and 4.0e-4)
    compare_runs(to_bf16, float32, rel=1e-4, weights_rel=5e-3)
    compare_runs(bf16, float32, rel=1e-4, weights_rel=5e-3)


def test_fsdp_2_with_bfloat16_states_equals_one_process(tmp_path):
    one = train(1, overrides(tmp_path, "one", 3, *BF16))
    fsdp = train(2, overrides(tmp_path, "fsdp", 3, "mesh.data_parallel_shard=2", *BF16))
    gap = spread(one, train(1, overrides(tmp_path, "f32", 3)))  # what bfloat16 states change
    # FSDP sums the gradients in another order; a last-bit difference can move a state across a
    # bfloat16 rounding boundary (measured: losses 1.2e-8, weights 1.6e-5 after 3 AdamW steps), well
    # under what the bfloat16 states themselves change (2.4e-4)
    found = compare_runs(fsdp, one, rel=1e-5, weights_rel=1e-3)
    assert found.weights < gap.weights / 5, (found, gap)
