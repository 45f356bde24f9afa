"""`trainer.attention.backend` through the trainer on CPU: every kernel CPU has gives the same numbers,
and the kernel asked is the one that ran, forward, backward and recompute.

The tiny quickstart (float32, SGD, no clipping) trains 3 steps per backend in a forked process under
torch.profiler, which names the SDPA kernel of every call: `_scaled_dot_product_flash_attention_for_cpu`
(and its backward) or `_scaled_dot_product_attention_math`. The counts are exact: one call per layer
per microbatch per step (twice with full activation checkpointing: the recompute in backward), and
at pp 2 each stage's layers, plus torch's metadata-inference forward of the first step; an eval
forward runs it too. Numbers are compared with `math`, the reference: measured, flash (and auto,
which is flash on CPU) differ from it by ~1e-7 relative in the losses, grad norms and weights. What CPU cannot show: cuDNN, efficient and
FlexAttention training, and which kernel `auto` picks on a GPU (tests of `resolve_attention`).
"""

import collections
from pathlib import Path
from typing import Any

import pytest
from _quickstart import (
    CONFIG,
    NO_CLIP,
    SGD,
    RunResult,
    compare_runs,
    overrides,
    records,
    run_forked,
    run_main,
)

from d9d.mesh.testing import run_distributed

STEPS = 3
LAYERS = 2  # the tiny quickstart's (_quickstart.TINY)
MICROBATCHES = 8  # global batch 16 / microbatch 2
#: One eval microbatch after the last step (eval forwards run under the kernel too).
EVAL = ["providers.eval_dataset=train.py:CorpusProvider", "eval_dataset.path=../data/passages.txt",
        "eval_dataset.seq_len=32", "eval.period_steps=0", "eval.microbatch_size=2", "eval.steps=1"]  # fmt: skip
FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"
FLASH_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
MATH = "aten::_scaled_dot_product_attention_math"


def _train_counting_kernels(args: list[str]) -> dict[str, Any]:
    """Train; the SDPA kernel ops that ran (profiler names) and this rank's full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.profiler import ProfilerActivity, profile

    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        weights = {name: t.detach().cpu().clone() for name, t in state.items()}
    ops = collections.Counter(e.name for e in prof.events() if e.name in (FLASH, FLASH_BACKWARD, MATH))
    return {"ops": dict(ops), "weights": weights}


def _run(tmp_path: Path, name: str, *extra: str, nproc: int = 1) -> tuple[RunResult, list[dict[str, int]]]:
    args = overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, "trainer.logging.level=WARNING", *extra)
    if nproc == 1:
        ranks = [run_forked(_train_counting_kernels, args, timeout=600)]
    else:
        ranks = run_distributed(_train_counting_kernels, nproc, args, timeout=600)
    weights = {k: v for rank in ranks for k, v in rank["weights"].items()}
    return RunResult(records(tmp_path / name), weights), [rank["ops"] for rank in ranks]


def _expected(kernel: str, calls: int) -> dict[str, int]:
    return {FLASH: calls, FLASH_BACKWARD: calls} if kernel == "flash" else {MATH: calls}


@pytest.fixture(scope="module")
def math_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, list[dict[str, int]]]:
    return _run(tmp_path_factory.mktemp("attention"), "math", "trainer.attention.backend=math", *EVAL)


def test_math_runs_the_math_kernel_in_every_call_and_the_eval(math_run):
    result, ops = math_run
    assert "eval_loss" in result.records[-1]
    assert ops == [_expected("math", LAYERS * (MICROBATCHES * STEPS + 1))], ops


@pytest.mark.parametrize("backend", ["flash", "auto"])
def test_each_cpu_kernel_gives_the_math_kernels_numbers(tmp_path, math_run, backend):
    result, ops = _run(tmp_path, backend, f"trainer.attention.backend={backend}")
    assert ops == [_expected("flash", LAYERS * MICROBATCHES * STEPS)], ops  # auto on CPU: flash
    spread = compare_runs(result, math_run[0], rel=1e-5)
    print(f"{backend} against math: {spread}")
    assert spread.loss > 0 or spread.weights > 0, "another kernel, yet bit-identical: did the kernel change?"


def test_the_recompute_in_backward_runs_the_kernel_asked(tmp_path, math_run):
    # full activation checkpointing: each layer's forward runs again in backward, inside the step's
    # restriction too (outside it SDPA would pick flash on CPU)
    result, ops = _run(
        tmp_path, "ac", "trainer.attention.backend=math", "trainer.activation_checkpointing.mode=full"
    )
    assert ops == [_expected("math", 2 * LAYERS * MICROBATCHES * STEPS)], ops
    compare_runs(result, math_run[0], rel=1e-6)


def test_the_pipeline_schedule_runs_the_kernel_asked_on_every_stage_2ranks(tmp_path, math_run):
    result, ops = _run(tmp_path, "pp", "trainer.attention.backend=math", "mesh.pipeline_parallel=2",
                       "pipelining.schedule=1f1b", nproc=2)  # fmt: skip
    per_stage = LAYERS // 2
    probe = per_stage  # torch's metadata-inference forward of the first step, one microbatch per stage
    assert ops == [_expected("math", per_stage * MICROBATCHES * STEPS + probe)] * 2, ops
    compare_runs(result, math_run[0], rel=1e-5)


def test_the_job_built_line_says_which_kernel_and_why(tmp_path):
    done = run_main(overrides(tmp_path, "line", 1, "trainer.logging.format=json"))
    assert done.returncode == 0, done.stderr[-2000:]
    built = [line for line in done.stdout.splitlines() if '"job built"' in line]
    assert len(built) == 1 and '"attention": "flash (auto on cpu)"' in built[0], built
