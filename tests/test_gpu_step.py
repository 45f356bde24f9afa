"""The GPU-grade step, proven on CPU: bf16 compute with fp32 master weights and reductions on every
mesh (a dispatch-mode recorder of matmul, collective and activation dtypes is the proof; the
bf16-vs-fp32 loss comparison only bounds the drift), activation checkpointing that changes memory
but not numbers, and in-place compile."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _dispatch import OpRecorder
from _quickstart import CONFIG, MOE, TINY, overrides, run_forked

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer

BF16 = ["trainer.precision.param_dtype=bfloat16", "trainer.checkpointing.period_steps=0"]
HIDDEN = int(next(a for a in TINY if a.startswith("model.hidden_size=")).split("=")[1])


class _ActivationDtypes:
    """(module class, dtype) of every module output shaped [batch, seq, hidden] during a step.

    nn.Embedding is left out: its output is the float32 table lookup, which the model casts to the
    compute dtype as its next operation (what is checked is the residual stream after it).
    """

    def __init__(self) -> None:
        self.seen: set[tuple[str, str]] = set()

    def __enter__(self) -> "_ActivationDtypes":
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _hook(self, module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(module, torch.nn.Embedding) or not isinstance(output, torch.Tensor):
            return
        if output.ndim == 3 and output.is_floating_point() and output.shape[-1] == HIDDEN:
            self.seen.add((type(module).__name__, str(output.dtype)))


def _one_step(args: list[str]) -> dict:
    """One training step under the recorder; what the precision contract is about."""
    with Trainer.from_config(CONFIG, args) as trainer:
        recorder = OpRecorder()
        with recorder, _ActivationDtypes() as activations:
            trainer.train()
        opt = trainer.optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        state = [
            t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.ndim > 0
        ]
        return {
            "matmuls": [(name, [str(d) for d in dtypes]) for name, dtypes in recorder.matmuls],
            # parameter gradients (flat buckets, shards); an activation's gradient [batch, seq, hidden]
            # (tensor parallel's sequence-parallel reduce-scatter) travels in the compute dtype
            "grad_reductions": [
                (name, [str(d) for d in dtypes])
                for name, dtypes, bwd, shapes in recorder.reductions
                if bwd and not _is_activation(shapes)
            ],
            # in backward (the forward's one is the vocab-parallel embedding's float32 lookup)
            "activation_reductions": sorted(
                {
                    (name, str(d))
                    for name, dtypes, bwd, shapes in recorder.reductions
                    if bwd and _is_activation(shapes)
                    for d in dtypes
                }
            ),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "state_dtypes": sorted({str(t.dtype) for t in state}),
            "activations": sorted(activations.seen),
        }


def _is_activation(shapes: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(shape) == 3 and shape[-1] == HIDDEN for shape in shapes)


MESHES = {
    "local": [],
    "ddp2": ["mesh.data_parallel_replicate=2"],
    "fsdp2": ["mesh.data_parallel_shard=2"],
    "tp2": ["mesh.tensor_parallel=2"],
    "pp2": ["mesh.pipeline_parallel=2"],
    "ep2": ["mesh.data_parallel_shard=2", "mesh.expert_parallel=2", *MOE],
}


@pytest.mark.parametrize("mesh", list(MESHES), ids=list(MESHES))
def test_bf16_matmuls_fp32_master_weights_and_reductions(tmp_path, mesh):
    args = overrides(tmp_path, "bf16", 1, *BF16, *MESHES[mesh])
    # local: forked too, as no test trains in the pytest process (a backward there, after an in-process
    # `d9d plan`, leaves autograd's fork handler set: every later forked rank's backward then fails)
    results = (
        [run_forked(_one_step, args, timeout=180)]
        if mesh == "local"
        else run_distributed(_one_step, 2, args, timeout=180)
    )
    for rank, seen in enumerate(results):
        assert seen["matmuls"], f"rank {rank} ran no matmul"
        for name, dtypes in seen["matmuls"]:
            # sdpa's backward also takes its fp32 softmax statistics: the tensors it multiplies come first
            checked = dtypes[:3] if "scaled_dot_product" in name else dtypes
            assert set(checked) == {"torch.bfloat16"}, (rank, name, dtypes)
        for name, dtypes in seen["grad_reductions"]:
            assert set(dtypes) == {"torch.float32"}, (rank, name, dtypes)
        if mesh in ("ddp2", "fsdp2", "ep2"):
            assert seen["grad_reductions"], f"rank {rank}: no gradient reduction seen"
        if mesh == "tp2":  # sequence parallel: the activations' collectives are bf16 like the activations
            assert seen["activation_reductions"], f"rank {rank}: no activation reduction seen"
            assert {d for _, d in seen["activation_reductions"]} == {"torch.bfloat16"}, seen
        assert seen["param_dtypes"] == ["torch.float32"]
        assert seen["state_dtypes"] == ["torch.float32"]
        # the residual stream, norms, attention and MLP outputs are bf16 on the autocast meshes
        # (local, tp2, pp2) as on the FSDP ones: no [batch, seq, hidden] activation is float32
        modules = {name for name, _ in seen["activations"]}
        # (FSDP and DDP rename a wrapped module's class: FSDPDecoderLayer, ReplicateDecoderLayer)
        assert "RMSNorm" in modules and any(m.endswith("DecoderLayer") for m in modules), (rank, modules)
        fp32 = [name for name, dtype in seen["activations"] if dtype != "torch.bfloat16"]
        assert not fp32, (rank, mesh, seen["activations"])


def _train_records(tmp_path: Path, name: str, steps: int, *extra: str, nproc: int = 1) -> list[dict]:
    args = overrides(tmp_path, name, steps, "trainer.checkpointing.period_steps=0", *extra)
    if nproc == 1:
        run_forked(_train, args, timeout=300)  # one plain process, forked: no interpreter start-up
    else:
        run_distributed(_train, nproc, args, timeout=300)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _train(args: list[str]) -> None:
    """The job as train.py runs it: train, then export when export.dir is set."""
    from d9d.trainer import run_job

    run_job(CONFIG, args)


#: Enough steps to learn (the last 5 below 0.8 of the first loss) at the quickstart's lr.
STEPS_BF16 = 30


def test_bf16_quickstart_tracks_fp32_on_one_process_and_fsdp2(tmp_path):
    # This bounds how far bf16 drifts from fp32; it would also pass with autocast off (fp32 on both
    # sides). That bf16 is really computed is proven by the dtype recorder above
    # (test_bf16_matmuls_fp32_master_weights_and_reductions), not here.
    fp32 = _train_records(tmp_path, "fp32", STEPS_BF16)
    bf16 = _train_records(tmp_path, "bf16", STEPS_BF16, "trainer.precision.param_dtype=bfloat16")
    bf16_fsdp = _train_records(
        tmp_path,
        "bf16_fsdp",
        STEPS_BF16,
        "trainer.precision.param_dtype=bfloat16",
        "mesh.data_parallel_shard=2",
        nproc=2,
    )

    def final(records: list[dict]) -> float:  # mean of the last 5 steps: one step's loss is noisy
        return sum(r["loss"] for r in records[-5:]) / 5

    assert final(fp32) < 0.8 * fp32[0]["loss"]  # it learned something worth comparing
    assert final(bf16) == pytest.approx(final(fp32), rel=0.02)
    assert final(bf16_fsdp) == pytest.approx(final(fp32), rel=0.02)
    # the two bf16 runs: the same numerics up to bf16 rounding, step by step
    for a, b in zip(bf16, bf16_fsdp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2), a["step"]


def test_activation_checkpointing_changes_no_number(tmp_path):
    eager = _train_records(
        tmp_path, "plain", 4, "trainer.checkpointing.period_steps=0", "export.dir=" + str(tmp_path / "e0")
    )
    full = _train_records(
        tmp_path,
        "full",
        4,
        "trainer.activation_checkpointing.mode=full",
        "export.dir=" + str(tmp_path / "e1"),
    )
    selective = _train_records(
        tmp_path,
        "sel",
        4,
        "trainer.activation_checkpointing.mode=selective",
        "trainer.activation_checkpointing.every=2",
    )
    per_op = _train_records(
        tmp_path, "op", 4, "trainer.activation_checkpointing.mode=op", "export.dir=" + str(tmp_path / "e2")
    )
    for other in (full, selective, per_op):
        for a, b in zip(eager, other, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6, abs=1e-7)
    _assert_same_weights(tmp_path / "e0", tmp_path / "e1", atol=1e-6)
    assert [(r["loss"], r["grad_norm"]) for r in per_op] == [(r["loss"], r["grad_norm"]) for r in eager]
    _assert_same_weights(tmp_path / "e0", tmp_path / "e2")  # op: bit for bit


@pytest.mark.parametrize(
    "mesh",
    [["mesh.data_parallel_shard=2"], ["mesh.tensor_parallel=2"], ["mesh.pipeline_parallel=2"],
     ["mesh.data_parallel_shard=2", "mesh.expert_parallel=2", *MOE]],
    ids=["fsdp2", "tp2", "pp2", "ep2"],
)  # fmt: skip
def test_activation_checkpointing_on_two_ranks_changes_no_number(tmp_path, mesh):
    plain = _train_records(tmp_path, "plain", 3, *mesh, nproc=2)
    for mode in ("full", "op"):
        runs = _train_records(
            tmp_path, mode, 3, *mesh, f"trainer.activation_checkpointing.mode={mode}", nproc=2
        )
        for a, b in zip(plain, runs, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7), mode
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6, abs=1e-7), mode


def _assert_same_weights(a: Path, b: Path, *, atol: float = 0.0) -> None:
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in b.glob("*.safetensors"))
    for name in files:
        wa, wb = load_file(a / name), load_file(b / name)
        assert wa.keys() == wb.keys()
        for key in wa:
            torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=atol, msg=key)


def test_full_activation_checkpointing_halves_saved_bytes_of_the_quickstart_model():
    import copy

    import torch.nn.functional as F

    from d9d.parallel import (
        ActivationCheckpointingConfig,
        apply_activation_checkpointing,
        saved_activation_bytes,
    )
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig

    config = ReferenceModelConfig(  # examples/quickstart/config.yaml's model, its seq_len and microbatch
        vocab_size=257,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = ReferenceForCausalLM(config)
    ids = torch.randint(0, 257, (2, 128))
    measured = {}
    for mode in ("none", "selective", "full"):
        copy_ = copy.deepcopy(model)
        apply_activation_checkpointing(
            list(copy_.model.layers.values()), ActivationCheckpointingConfig(mode=mode)
        )
        measured[mode] = saved_activation_bytes(
            lambda m=copy_: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()), exclude=copy_.parameters()
        )
    assert measured["full"] <= 0.5 * measured["none"], measured
    assert measured["full"] < measured["selective"] < measured["none"], measured


COMPILE = "trainer.compile.enabled=true"


def _run_local_ok(tmp_path: Path, name: str, steps: int, *extra: str) -> list[dict]:
    """One plain process (forked, as the e2e tests' one-process runs), the job's export included."""
    args = overrides(tmp_path, name, steps, "trainer.checkpointing.period_steps=3", *extra)
    run_forked(_train_and_export_compiled, args, timeout=300)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _train_and_export_compiled(args: list[str]) -> None:
    import torch._inductor.config as inductor_config

    from d9d.trainer import run_job

    inductor_config.compile_threads = 1  # no compile worker pool inside a forked process
    run_job(CONFIG, args)  # as train.py runs it: train, then export when export.dir is set


def _assert_steps_match(records: list[dict], reference: list[dict], tol: float = 1e-5) -> None:
    by_step = {r["step"]: r for r in reference}
    assert records
    for r in records:
        ref = by_step[r["step"]]
        assert r["loss"] == pytest.approx(ref["loss"], rel=tol, abs=tol), r["step"]
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=tol, abs=tol), r["step"]


def test_compiled_run_equals_eager_and_resumes_across_compile(tmp_path):
    """Compile changes no number and no key: compiled and eager runs continue each other's checkpoints."""
    eager = _run_local_ok(tmp_path, "eager", 5, "export.dir=" + str(tmp_path / "export_eager"))
    # steps 1-3 compiled, then 4-5 eager from the compiled run's checkpoint
    compiled_first = _run_local_ok(tmp_path, "c_then_e", 3, COMPILE)
    eager_after = _run_local_ok(tmp_path, "c_then_e", 5)
    _assert_steps_match(compiled_first, eager)
    _assert_steps_match(eager_after[3:], eager)
    assert [r["step"] for r in eager_after] == [1, 2, 3, 4, 5]
    # the other way round: a compiled model loads the eager run's final checkpoint (compiled steps
    # equal eager ones: steps 1-3 above) and exports it to the very same bytes
    _run_local_ok(tmp_path, "eager", 5, COMPILE, "export.dir=" + str(tmp_path / "export_compiled"))
    files = sorted(p.name for p in (tmp_path / "export_eager").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "export_compiled").iterdir())
    for name in files:
        assert (tmp_path / "export_eager" / name).read_bytes() == (
            tmp_path / "export_compiled" / name
        ).read_bytes()


def _train_compiled(args: list[str]) -> None:
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile worker pool inside a forked test rank
    _train(args)


@pytest.mark.parametrize(
    "mesh", ["mesh.data_parallel_shard=2", "mesh.pipeline_parallel=2"], ids=["fsdp2", "pp2"]
)
def test_compiled_two_ranks_equal_eager(tmp_path, mesh):
    args = ["trainer.checkpointing.period_steps=0", mesh]
    run_distributed(_train, 2, overrides(tmp_path, "eager", 5, *args), timeout=300)
    run_distributed(_train_compiled, 2, overrides(tmp_path, "compiled", 5, *args, COMPILE), timeout=600)
    _assert_steps_match(losses_records(tmp_path, "compiled"), losses_records(tmp_path, "eager"))


def losses_records(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_device_cuda_without_a_usable_gpu_is_one_clear_error_and_writes_nothing(tmp_path):
    import os
    import subprocess

    from _quickstart import TRAIN

    args = overrides(tmp_path, "cuda", 2, "trainer.device=cuda")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, TRAIN, CONFIG, *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "trainer.device: cpu" in errors[0] and "CUDA_VISIBLE_DEVICES" in errors[0], errors[0]
    assert not os.path.exists(tmp_path / "cuda")
