"""`d9d plan`'s activation figures against the bytes a real run keeps saved for backward.

Each rank of a real run (forked processes, gloo) counts, during one optimizer step after a first
one, the peak of the bytes autograd holds saved for backward (`d9d.parallel.SavedActivations`: each
storage once, from its pack until the graph lets it go; weights and the step's compute copies of
them left out, as the plan counts those apart). The plan of the same job (the trainer's `plan_job`
on a planning context of each rank, for the CPU) must be within 0.1% of it on every rank (the issue
asked for 10%), on one process, FSDP 2, TP 2, PP 2 (each stage: 1F1B keeps pp − s microbatches in
flight on stage s) and CP 2 (each rank: the CPU's attention pads its query chunks, whose lengths
differ by rank), in float32 and bfloat16, without checkpointing, with full and with op
checkpointing. Measured on the tiny quickstart: every one of the 60 figures 4 bytes over the plan.
The figures they replace fail it: the whole model at one microbatch for every pp rank (2× off on the
1F1B stages), the one-process figure divided by tp (7.7% under), the CUDA attention path under CP on
the CPU (9-13% under). A LoRA job, on one process, is planned as it trains (adapters, frozen
weights), not as a full fine-tune.
"""

from typing import Any

import pytest
from _quickstart import CONFIG, TINY, planned_activations, run_forked, saved_activation_peaks, second_steps

from d9d.mesh.testing import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: name: (processes, overrides)
MESHES = {
    "one": (1, []),
    "fsdp2": (2, ["mesh.data_parallel_shard=2"]),
    "tp2": (2, ["mesh.tensor_parallel=2"]),
    "pp2_1f1b": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
    "pp2_gpipe": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=gpipe"]),
    "cp2": (2, ["mesh.context_parallel=2"]),
}
DTYPES = ("float32", "bfloat16")
MODES = ("none", "full", "op")


def _args(mesh: list[str], dtype: str = "float32", mode: str = "none") -> list[str]:
    return [
        *TINY,
        "mesh.data_parallel_shard=1",
        *mesh,
        f"trainer.precision.param_dtype={dtype}",
        f"trainer.activation_checkpointing.mode={mode}",
        "trainer.schedule.total_steps=2",
        "trainer.checkpointing.period_steps=100",
    ]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_plans_activations_are_the_measured_ones_on_every_rank_dtype_and_checkpointing(mesh, tmp_path):
    world, sets = MESHES[mesh]
    variants = [_args(sets, dtype, mode) for dtype in DTYPES for mode in MODES]
    planned = run_forked(planned_activations, variants, world)
    root = str(tmp_path)
    if world == 1:
        measured = [run_forked(saved_activation_peaks, root, variants)]
    else:
        measured = run_distributed(saved_activation_peaks, world, root, variants, timeout=300)
    for v, (dtype, mode) in enumerate((d, m) for d in DTYPES for m in MODES):
        for rank in range(world):
            plan, real = planned[v][rank], measured[rank][v]
            assert real > 0, (mesh, dtype, mode, rank)
            assert abs(plan - real) <= 0.001 * real, (
                f"{mesh} {dtype} {mode} rank {rank}: planned {plan}, measured {real}"
            )
        figures = dict(zip(MODES, [measured[0][DTYPES.index(dtype) * 3 + i] for i in range(3)], strict=True))
        assert figures["full"] < figures["op"] < figures["none"] or mesh == "tp2", (mesh, dtype, figures)
    if mesh == "pp2_1f1b":  # stage 0 holds two microbatches in flight, the last stage one (+ the loss)
        assert planned[0][0] != planned[0][1]


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
    counted as the kernel itself). It used to plan a full fine-tune's 818,692 and 148,996 (+26%, +29%).
    (Figures with the full logits, before the fused head loss.)"""
    ac = [f"trainer.activation_checkpointing.mode={mode}"]
    args = _args([*ac, LORA])
    planned = planned_activations([args], 1)[0][0]
    measured = run_forked(saved_activation_peaks, str(tmp_path), [args])[0]
    assert abs(planned - measured) <= 0.01 * measured, f"planned {planned}, measured {measured}"
    full_fine_tune = planned_activations([_args(ac)], 1)[0][0]
    assert planned < 0.9 * full_fine_tune


def test_a_schedule_without_a_closed_form_is_planned_as_an_upper_bound_and_says_so(tmp_path):
    args = _args(["mesh.pipeline_parallel=2", "pipelining.schedule=interleaved_1f1b"])
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


def _recomputed_and_held(root: str, variants: list[list[str]]) -> list[int]:
    """Per variant: the most bytes one checkpointed block's recompute made and handed to the backward
    at once, during the second optimizer step. A recompute's saved tensors pass through torch's own
    saved-tensor hooks (`torch.utils.checkpoint._recomputation_hook`), which no outer hook sees, so
    this test wraps that class: the tensors the frame holds for the backward when the recompute ends,
    each storage once, those born during it (what it added to memory)."""
    import torch.utils.checkpoint as checkpointing

    from d9d.mesh.testing import StorageCensus
    from d9d.trainer import Trainer

    original = checkpointing._recomputation_hook
    most = [0] * len(variants)

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, frame_ref: Any, gid: Any) -> None:
            super().__init__(frame_ref, gid)
            self._frame_ref, self._gid, self._census = frame_ref, gid, StorageCensus()

        def __enter__(self) -> Any:
            self._census.__enter__()
            return super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            out = super().__exit__(*exc)
            self._census.__exit__(None, None, None)
            held = {
                t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in self._frame_ref().recomputed[self._gid].values()
                if t.untyped_storage()._cdata in self._census._born
            }
            most[variant] = max(most[variant], sum(held.values()))
            return out

    for variant, args in enumerate(variants):
        sets = [*args, f"trainer.checkpointing.save_dir={root}/{variant}", "trainer.run.name=recompute"]
        with Trainer.from_config(CONFIG, sets) as trainer:
            batches = iter(trainer.data)
            trainer.train_step.run(next(batches), 1)
            checkpointing._recomputation_hook = Counted
            try:
                trainer.train_step.run(next(batches), 2)
            finally:
                checkpointing._recomputation_hook = original
    return most


def test_the_plans_peak_adds_what_a_checkpointed_blocks_recompute_holds(tmp_path):
    """Under checkpointing a block's backward first recomputes its forward and holds what it saves;
    the plan adds one block's worth (`recompute`: the bytes checkpointing spared it) to its peak.
    Measured on one process: full 314,368 (fp32) and 195,584 (bf16) bytes, planned 318,464 and
    189,440; op 198,656 and 149,504, planned 169,984 and 114,688 (op's recompute makes more than it
    spared: an under-estimate, by up to 23% of the transient, 10% of the step's peak)."""
    variants = [_args([], dtype, mode) for dtype in DTYPES for mode in ("full", "op")]
    held = run_forked(_recomputed_and_held, str(tmp_path), variants)
    saved = run_forked(saved_activation_peaks, str(tmp_path / "saved"), variants)
    for args, recomputed, checkpointed in zip(variants, held, saved, strict=True):
        (acts,) = [_plan_of_rank_0(args).activations]
        assert recomputed > 0 and acts.recompute > 0, (args, recomputed)
        assert acts.peak == acts.checkpointed + acts.recompute
        full = "trainer.activation_checkpointing.mode=full" in args
        if full:  # the full recompute: within 4%
            assert abs(acts.recompute - recomputed) <= 0.04 * recomputed, (args, acts.recompute, recomputed)
        real = checkpointed + recomputed  # the step's most: the held peak plus one block's recompute
        assert abs(acts.peak - real) <= 0.1 * real, (args, acts.peak, real)


#: name: (processes, overrides). Long-context shapes on the tiny model: CP 4 and CP 8 (seq 32: 2·cp
#: chunks of 4 and 2 tokens), and packed rows (document masks) on CP 2 and on CP 4 × TP 2 (vocabulary
#: 264: the byte tokenizer's 257 rows do not materialize on FSDP 4 × TP 2, with or without cp).
LONG_CONTEXT = {
    "cp4": (4, ["mesh.context_parallel=4"]),
    "cp8": (8, ["mesh.context_parallel=8"]),
    "cp2_packed": (2, ["mesh.context_parallel=2", "dataset.document_masking=true"]),
    "cp4_tp2_packed": (
        8,
        [
            "mesh.context_parallel=4",
            "mesh.tensor_parallel=2",
            "model.vocab_size=264",
            "dataset.document_masking=true",
        ],
    ),
}


@pytest.mark.parametrize("mesh", list(LONG_CONTEXT))
def test_the_plans_activations_are_the_measured_ones_at_long_context_shapes(mesh, tmp_path):
    """CP 4 and CP 8 (each rank's two chunks padded to squares by the CPU path), and packed rows under
    CP 2 and CP 4 × TP 2, where the CPU's attention also saves each query chunk's mask (float, q's
    dtype, [chunk, keys it sees]). Measured on the tiny quickstart, float32: every figure 4 bytes over
    the plan; packed rows were planned 1.3% under before the mask was counted."""
    world, sets = LONG_CONTEXT[mesh]
    variants = [_args(sets, "float32", mode) for mode in ("none", "full")]
    planned = run_forked(planned_activations, variants, world)
    measured = run_distributed(saved_activation_peaks, world, str(tmp_path), variants, timeout=300)
    for v, mode in enumerate(("none", "full")):
        for rank in range(world):
            plan, real = planned[v][rank], measured[rank][v]
            assert real > 0, (mesh, mode, rank)
            assert abs(plan - real) <= 0.001 * real, (
                f"{mesh} {mode} rank {rank}: planned {plan}, measured {real}"
            )


def _saved_keys_values(root: str, variants: list[list[str]]) -> list[tuple[int, int]]:
    """Per variant: the bytes of all-gathered K/V that the second optimizer step's forwards saved for
    backward (outside checkpointed blocks), and how many attention calls gathered them."""
    from d9d.parallel import recording_gathered_keys_values, saved_activation_bytes_among

    out = []
    for trainer, step in second_steps(root, variants, "kv"):
        with recording_gathered_keys_values() as kv:
            _, held = saved_activation_bytes_among(step, among=kv, exclude=trainer.model.parameters())
        out.append((held, len(kv) // 2))
    return out


def test_the_plan_names_the_all_gathered_keys_and_values_as_a_real_run_keeps_them(tmp_path):
    """The plan's K/V (`ActivationEstimate.kv`: what the layers not checkpointed keep of the full-length
    K and V; `kv_layer`: one layer's) against a real CP 4 step on each rank, all of its microbatches:
    without checkpointing every layer keeps its K/V, with full checkpointing none outside a
    recompute. Measured: exactly the plan's bytes."""
    world = 4
    variants = [_args(["mesh.context_parallel=4"], "float32", mode) for mode in ("none", "full")]
    measured = run_distributed(_saved_keys_values, world, str(tmp_path), variants, timeout=300)
    layers = 2  # TINY's model.num_layers
    plans = [run_forked(_plan_of_rank_0, args).activations for args in variants]
    for rank in range(world):
        (none_bytes, calls), (full_bytes, _) = measured[rank]
        microbatches = calls // layers
        assert microbatches > 1 and none_bytes > 0
        assert plans[0].kv_layer == none_bytes // calls
        assert plans[0].kv == plans[0].kv_layer * layers == none_bytes // microbatches
        assert full_bytes == plans[1].kv == 0 and plans[1].kv_layer == plans[0].kv_layer
