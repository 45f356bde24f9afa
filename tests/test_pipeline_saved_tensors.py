"""Through the trainer: nothing a pipeline step (or an eval through the stages) makes outlives it,
on either stage.

The quickstart on 2 forked pipeline ranks (1F1B, the schedule the leak was reported on); each rank
wraps its `PipelineStep.run` in the `SavedTensors` registry of d9d-parallel's pipeline tests (why it
keeps tensors detached is said there) and in a `d9d.mesh.testing.StorageCensus` (no hook), and reads,
after every step and a full garbage collection, the bytes still saved for backward and the bytes of
every storage the step made still alive, but what it keeps on purpose (weights, gradients, optimizer
state, its output and weight scale, the MoE layers' routing statistics, the microbatches). Measured
on torch 2.15 and 2.11: 0 and 0 on both ranks after every step. A saved-tensor count keeping the
tensors themselves reports 325 KB held on rank 0 on torch 2.15 (the first step's metadata-inference
graph, freed without the hooks), which is how a leak was once reported; on torch 2.11 the census found
the receive buffers torch keeps between steps, which `Pipeline.step` now frees.

The MoE variant too: `MoE.last_stats` once kept its last forward's aux-loss graph, whose nodes
never run backward when no balancing loss is trained (20 bytes still saved on each stage here,
2 x num_experts floats per MoE layer, on every step kind); the step detaches them once backward is done.
"""

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _quickstart import CONFIG, MOE, NO_CLIP, SGD, overrides

from d9d.mesh.testing import run_distributed

PIPELINE_TESTS = Path(__file__).resolve().parents[1] / "packages" / "d9d-parallel" / "tests" / "pipeline"
sys.path.insert(0, str(PIPELINE_TESTS))
from _alive_storages import StorageCensus, training_state  # noqa: E402
from _saved_tensors import SavedTensors  # noqa: E402

STEPS = 2  # the first (with torch's metadata inference) and a steady one


def _saved_after_each_step(args: list[str]) -> dict[str, list[Any]]:
    from d9d.parallel.expert import moe_layers
    from d9d.trainer import Trainer
    from d9d.trainer.step.pipeline import PipelineStep

    saved = SavedTensors()
    after: list[int] = []
    packed: list[int] = []
    alive: list[tuple[int, list[str]]] = []
    run = PipelineStep.run

    def recorded_run(self: PipelineStep, microbatches: list[object], step: int) -> object:
        before = saved.packed_bytes
        census = StorageCensus()
        with saved.recording(), census:
            output = run(self, microbatches, step)
        packed.append(saved.packed_bytes - before)
        after.append(saved.alive()[1])
        # with no hook: what the step made that is alive after it, but what it keeps on purpose: the
        # training state, the step's output and weight scale, the MoE layers' routing statistics
        kept = [*training_state(self.model, self.optimizer), self._scale, output]
        kept += [layer.last_stats for layer in moe_layers(self.model)]
        alive.append(census.alive([microbatches, *kept]))
        return output

    PipelineStep.run = recorded_run  # type: ignore[method-assign]  # this forked rank only
    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
    return {"after": after, "packed": packed, "alive": alive}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_no_saved_tensor_outlives_a_trainer_pipeline_step_2ranks(tmp_path, model):
    args = overrides(tmp_path, "pp2", STEPS, *SGD, *NO_CLIP, "mesh.pipeline_parallel=2",
                     "pipelining.schedule=1f1b", "trainer.checkpointing.period_steps=100",
                     *(MOE if model == "moe" else []))  # fmt: skip
    for pp_rank, rank in enumerate(run_distributed(_saved_after_each_step, 2, args, timeout=300)):
        assert len(rank["packed"]) == STEPS and all(b > 0 for b in rank["packed"]), (pp_rank, rank)
        assert rank["after"] == [0] * STEPS, (
            f"rank {pp_rank}: bytes still saved for backward after each step: {rank['after']}"
        )
        assert [size for size, _ in rank["alive"]] == [0] * STEPS, (
            f"rank {pp_rank}: storages of the schedule still alive after each step: {rank['alive']}"
        )


def _alive_after_each_eval(args: list[str]) -> dict[str, list[Any]]:
    from d9d.trainer import Trainer
    from d9d.trainer.run.evaluation import Evaluator

    saved = SavedTensors()
    packed: list[int] = []
    alive: list[tuple[int, list[str]]] = []
    seen: list[int] = []
    run = Evaluator.run

    def recorded_run(self: Evaluator, step: int) -> object:
        census = StorageCensus()
        before = saved.packed_bytes
        with saved.recording(), census:
            result = run(self, step)
        packed.append(saved.packed_bytes - before)
        seen.append(census.seen)
        alive.append(_settled_alive(census, training_state(self._model)))
        return result

    Evaluator.run = recorded_run  # type: ignore[method-assign]  # this forked rank only
    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
    return {"packed": packed, "alive": alive, "seen": seen}


def _settled_alive(census: StorageCensus, exclude: Any) -> tuple[int, list[str]]:
    """`census.alive(exclude)` once gloo's worker threads let go of the eval's last collective: its
    Work keeps the broadcast tensor until the worker releases it, after `wait()` has returned (seen on
    a loaded machine: the eval's 16-byte sums alive for a moment). Up to 1 s, then whatever is alive."""
    for _ in range(20):
        found = census.alive(exclude)
        if found[0] == 0:
            return found
        time.sleep(0.05)
    return census.alive(exclude)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_nothing_outlives_an_eval_on_pipeline_stages_2ranks(tmp_path, schedule):
    """The eval (forward only through the stages, `Pipeline.forward_only`) after steps 1 and 2: nothing
    saved for backward and no storage it made alive after it, on either rank. Measured: 0 and 0."""
    eval_args = ["providers.eval_dataset=train.py:CorpusProvider", "eval_dataset.path=../data/passages.txt",
                 "eval_dataset.seq_len=32", "eval.period_steps=1", "eval.microbatch_size=4", "eval.steps=3"]  # fmt: skip
    args = overrides(tmp_path, "pp2-eval", STEPS, *SGD, *NO_CLIP, "mesh.pipeline_parallel=2",
                     f"pipelining.schedule={schedule}", "trainer.checkpointing.period_steps=100",
                     *eval_args)  # fmt: skip
    for pp_rank, rank in enumerate(run_distributed(_alive_after_each_eval, 2, args, timeout=300)):
        assert len(rank["seen"]) == STEPS and all(n > 0 for n in rank["seen"]), (pp_rank, rank)
        assert rank["packed"] == [0] * STEPS, f"rank {pp_rank}: an eval saved tensors for backward: {rank}"
        assert [size for size, _ in rank["alive"]] == [0] * STEPS, (
            f"rank {pp_rank}: storages of the eval still alive after it: {rank['alive']}"
        )
