"""`d9d plan`'s activation figures against the bytes a real run keeps saved for backward.

Each rank of a real 2-process run (gloo, forked) counts, during one optimizer step after a first one,
the peak of the bytes autograd holds saved for backward (each storage once, parameters excluded: a
saved tensor counts from its pack until the graph lets it go). The plan of the same job (the
trainer's `plan_job` on a planning context, float32 on both sides) must be within 1% of it on every
rank (the issue asked for 10%; measured: 4 bytes under, since attention is counted as the CPU
kernel itself on the meta device, whose output the output projection takes as a view; before, a
stand-in with a contiguous output had the projection's input counted as a copy: 3.5–4.8% over): per
pipeline stage (1F1B keeps pp − s microbatches in flight on stage s; the last stage's logits and
loss) and per tensor-parallel rank (what tensor parallelism keeps whole counts whole).
The figures they replace fail it: the whole model at one microbatch for every pp rank (2× off on the
1F1B stages), and the one-process figure divided by tp (7.7% under). A LoRA job, on one process, is
planned as it trains (adapters, frozen weights), not as a full fine-tune.
"""

import weakref
from typing import Any

import pytest
import torch
from _quickstart import CONFIG, TINY, run_forked

from d9d.mesh.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MESHES = {
    "pp2_1f1b": ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"],
    "pp2_gpipe": ["mesh.pipeline_parallel=2", "pipelining.schedule=gpipe"],
    "tp2": ["mesh.tensor_parallel=2"],
}


def _args(tmp: str, mesh: list[str]) -> list[str]:
    return [
        *TINY,
        "mesh.data_parallel_shard=1",
        *mesh,
        "trainer.precision.param_dtype=float32",
        "trainer.schedule.total_steps=2",
        "trainer.checkpointing.period_steps=100",
        f"trainer.checkpointing.save_dir={tmp}",
        "trainer.run.name=acts",
    ]


class _Saved:
    """One saved tensor, counted in `_PeakSaved` while autograd holds it."""

    def __init__(self, tracker: "_PeakSaved", tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self.tensor, self._tracker, self._key = tensor, tracker, key
        tracker.hold(key, nbytes)
        weakref.finalize(self, tracker.release, key)


class _PeakSaved:
    """The peak of live saved-for-backward bytes (each storage once), parameters excluded, and the
    compute copies of the weights the step casts once (the plan counts those as `weight_copies`)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.excluded = {_key(p) for p in params}
        self.refs: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.live = self.peak = 0

    def hold(self, key: int, nbytes: int) -> None:
        entry = self.refs.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[0] += 1

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def pack(self, tensor: torch.Tensor) -> Any:
        key = _key(tensor)
        if key in self.excluded or key in _weight_copies():
            return tensor
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return _Saved(self, tensor, key, local.untyped_storage().nbytes())

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved


def _weight_copies() -> set[int]:
    """The storages of the copies the open `weights_cast_once` scope holds (the trainer's step)."""
    from d9d.parallel import weight_casts

    scope = weight_casts._active
    return {_key(c.copy) for c in scope._copies.values()} if scope is not None else set()


def _key(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage()._cdata


def _measured(args: list[str]) -> int:
    """This rank's peak saved bytes during the second optimizer step."""
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        batches = iter(trainer.data)
        trainer.train_step.run(next(batches), 1)
        tracker = _PeakSaved([p for p in trainer.model.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            trainer.train_step.run(next(batches), 2)
        return tracker.peak


def _planned(args: list[str], world: int) -> list[int]:
    """Every rank's planned activation bytes (plan_job on a planning context of each rank)."""
    from d9d.mesh import DistributedContext
    from d9d.trainer import load_job_config, resolve_job
    from d9d.trainer.planning import plan_job

    job = resolve_job(load_job_config(CONFIG, args))
    figures = []
    for rank in range(world):
        with DistributedContext.for_planning(job.config.mesh, rank=rank) as ctx:
            plan = plan_job(job, ctx, device="cpu", memory=True)
        assert plan.memory is not None and plan.memory.activations is not None, plan.memory
        figures.append(plan.memory.activations.checkpointed)
    return figures


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_plans_activations_are_within_ten_percent_of_a_real_runs_on_every_rank(mesh, tmp_path):
    args = _args(str(tmp_path), MESHES[mesh])
    planned = run_forked(_planned, args, 2)
    measured = run_distributed(_measured, 2, args)
    for rank, (plan, real) in enumerate(zip(planned, measured, strict=True)):
        assert real > 0, (mesh, rank)
        assert abs(plan - real) <= 0.01 * real, f"{mesh} rank {rank}: planned {plan}, measured {real}"
    if mesh == "pp2_1f1b":  # stage 0 holds two microbatches in flight, the last stage one (+ the loss)
        assert planned[0] != planned[1]


#: Adapters on every projection of the quickstart model.
LORA = (
    r"peft.lora={rank: 8, alpha: 16, "
    r"target_modules: ['.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)']}"
)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_lora_jobs_activations_are_planned_as_it_trains_them(mode, tmp_path):
    """A LoRA job saves less: a frozen weight's input only where something before it trains. Measured
    on one process (float32): 649,992 bytes without checkpointing (a full fine-tune: 785,928), 115,720
    with full (149,000); the plan says 649,988 and 115,716 (682,756, +5.0%, before attention was
    counted as the kernel itself). It used to plan a full fine-tune's 818,692 and 148,996 (+26%, +29%)."""
    ac = [f"trainer.activation_checkpointing.mode={mode}"]
    args = _args(str(tmp_path), [*ac, LORA])
    planned = run_forked(_planned, args, 1)[0]
    measured = run_forked(_measured, args)
    assert abs(planned - measured) <= 0.01 * measured, f"planned {planned}, measured {measured}"
    full_fine_tune = run_forked(_planned, _args(str(tmp_path), ac), 1)[0]
    assert planned < 0.9 * full_fine_tune


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_op_checkpointing_is_planned_as_it_runs_on_one_process(dtype, tmp_path):
    """`mode: op` keeps the matmul and attention outputs of every block: measured on the tiny
    quickstart, float32 445,960 bytes (none 785,928, full 149,000), planned 445,956; bfloat16 298,760
    (none 676,232, full 149,256), planned 298,628. In bfloat16 one process computes under autocast,
    and the head's weight copy, which its matmul saves, is most of the difference to full: the plan
    counts such copies (it did not: 11% under with op, 27% under without checkpointing)."""
    figures = {}
    for mode in ("none", "op", "full"):
        args = [*_args(str(tmp_path / mode), [f"trainer.activation_checkpointing.mode={mode}"])]
        args.append(f"trainer.precision.param_dtype={dtype}")  # the later override wins
        figures[mode] = run_forked(_planned, args, 1)[0], run_forked(_measured, args)
    planned, measured = figures["op"]
    assert abs(planned - measured) <= 0.01 * measured, f"{dtype}: planned {planned}, measured {measured}"
    assert figures["full"][1] < measured < figures["none"][1], figures
    for mode in ("none", "full"):
        plan, real = figures[mode]
        assert abs(plan - real) <= 0.01 * real, f"{dtype} {mode}: planned {plan}, measured {real}"


def test_a_schedule_without_a_closed_form_is_planned_as_an_upper_bound_and_says_so(tmp_path):
    args = _args(str(tmp_path), ["mesh.pipeline_parallel=2", "pipelining.schedule=interleaved_1f1b"])
    memory = run_forked(_plan_of_rank_0, args)
    acts = memory.activations
    assert acts.in_flight == (8, 8)  # two chunks on pp rank 0, 8 microbatches each
    assert acts.in_flight_note.startswith("interleaved_1f1b: an upper bound")
    assert memory.pp_ranks[0].activations == acts  # pp rank 0's is this rank's
    assert len(memory.pp_ranks) == 2 and all(r.activations.checkpointed > 0 for r in memory.pp_ranks)


def _plan_of_rank_0(args: list[str]) -> Any:
    from d9d.mesh import DistributedContext
    from d9d.trainer import load_job_config, resolve_job
    from d9d.trainer.planning import plan_job

    job = resolve_job(load_job_config(CONFIG, args))
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        plan = plan_job(job, ctx, device="cpu", memory=True)
    assert plan.memory is not None
    return plan.memory
