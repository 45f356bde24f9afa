"""Run the quickstart job (tiny overrides) and compare what runs left: losses, grad norms, weights.

Three ways to run it: a plain process (`run_local`), a real torchrun (`run_ranks`), or forked from
the test process (`train`: one plain process, or ranks joined by `d9d.mesh.testing.run_distributed`;
`run_main`: train.py's `main()` with its exit status and output), which skips a fresh interpreter per
rank. `compare_runs` is the one parity check of the e2e tests.
"""

import functools
import importlib.util
import io
import json
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from d9d.mesh.testing import run_distributed, run_torchrun
from d9d.trainer import Trainer, main  # here, once, not in every forked run (~3 s each)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "examples" / "quickstart" / "train.py")
CONFIG = str(ROOT / "examples" / "quickstart" / "config.yaml")

TINY = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "dataset.seq_len=32",
    "trainer.logging.period_steps=1",
    "trainer.checkpointing.period_steps=2",
    "lr_scheduler.name=constant",
    "lr_scheduler.warmup_steps=2",
]
MOE = ["model.moe={num_experts: 4, top_k: 2, moe_intermediate_size: 64}"]
#: SGD: no second moment to amplify reduction-order noise, so runs on other meshes agree to ~1e-6.
SGD = ["optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.weight_decay=0.0"]
#: Clipping out of reach: a gradient-scale error changes the update, hence the loss, not only the norm.
NO_CLIP = ["trainer.gradient_clipping.max_norm=null"]

_DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def quickstart_train_module() -> Any:
    """The quickstart's train.py as a module (loaded once), e.g. to subclass its model provider."""
    name = "_d9d_tests_quickstart_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def overrides(save_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    """The tiny quickstart with its checkpoints under save_dir/name."""
    return [*TINY, f"trainer.checkpointing.save_dir={save_dir}", f"trainer.run.name={name}",
            f"trainer.schedule.total_steps={steps}", *extra]  # fmt: skip


def run_local(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python train.py config.yaml ARGS` with no torchrun."""
    return subprocess.run(
        [sys.executable, TRAIN, CONFIG, *args], capture_output=True, text=True, timeout=timeout,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def run_main(
    args: list[str], *, config: str = CONFIG, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python train.py CONFIG ARGS` as its `main()` runs it, in a process forked from this one (no
    interpreter start-up), started in `cwd`: its exit status and what it wrote on stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = run_forked(_main_writing_to, config, list(args), str(out), str(err), cwd, timeout=timeout)
        return subprocess.CompletedProcess(
            [TRAIN, config, *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def run_cli(
    args: list[str], *, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`d9d ARGS` as the console script runs it, in a process forked from this one (no interpreter or
    torch start-up: ~5 s a command saved), started in `cwd`: its exit status, stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = run_forked(_main_writing_to, None, list(args), str(out), str(err), cwd, timeout=timeout)
        return subprocess.CompletedProcess(
            ["d9d", *args], code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def _main_writing_to(config: str | None, args: list[str], out: str, err: str, cwd: Path | None) -> int:
    """Run train.py's `main([config, *args])`, or with no config the `d9d` command's `main()` on `args`,
    writing to the files `out` and `err` as the process's stdout and stderr."""
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):  # the process's own stdout and stderr, as a subprocess's
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    try:
        if config is None:
            from d9d.cli.main import main as cli_main

            sys.argv = ["d9d", *args]
            cli_main()
        else:
            main([config, *args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()  # an uncaught error, as the interpreter would print it
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def run_ranks(nproc: int, args: list[str], timeout: float = 300) -> str:
    """`torchrun --nproc-per-node N train.py config.yaml ARGS`; returns the output, failing on error."""
    result = run_torchrun([TRAIN, CONFIG, *args], nproc_per_node=nproc, timeout=timeout)
    assert result.returncode == 0, result.output[-4000:]
    return result.output


def losses(save_dir: Path, name: str) -> list[float]:
    """Losses per step from the run's metrics file."""
    return [r["loss"] for r in records(save_dir / name)]


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step records (loss, grad_norm, lr, ...) of a run's metrics file."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in an export directory, by name."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    assert weights, f"no safetensors files in {export_dir}"
    return weights


# ---------------------------------------------------------------------------------------- results


@dataclass
class RunResult:
    """What a run left: its per-step records and its final weights (full tensors, by name)."""

    records: list[dict[str, Any]]
    weights: dict[str, torch.Tensor]

    @classmethod
    def read(cls, run_dir: Path, export_dir: Path) -> "RunResult":
        """From a run's metrics file and its export directory (runs in other processes)."""
        return cls(records(run_dir), exported_weights(export_dir))


@dataclass
class Spread:
    """Largest relative differences of one run from another: per-step loss and grad norm (|a-b|/|b|)
    and final weights (per tensor, ||a-b|| / ||b||), with where each was."""

    loss: float
    loss_step: int
    grad_norm: float
    grad_norm_step: int
    weights: float
    weights_name: str

    def __str__(self) -> str:
        return (
            f"loss {self.loss:.2e} (step {self.loss_step}), grad_norm {self.grad_norm:.2e} "
            f"(step {self.grad_norm_step}), weights {self.weights:.2e} ({self.weights_name})"
        )


def spread(actual: RunResult, expected: RunResult, *, steps: range | None = None) -> Spread:
    """The relative differences of `actual` from `expected` (steps: only those, else all of them)."""
    steps_a = [r["step"] for r in actual.records]
    steps_e = [r["step"] for r in expected.records]
    assert steps_a == steps_e, f"the runs logged other steps: {steps_a} vs {steps_e}"
    assert actual.weights.keys() == expected.weights.keys(), (
        f"other weights: {sorted(actual.weights.keys() ^ expected.weights.keys())}"
    )
    worst: dict[str, tuple[float, Any]] = {"loss": (0.0, 0), "grad_norm": (0.0, 0), "weights": (0.0, "")}
    for a, e in zip(actual.records, expected.records, strict=True):
        if steps is not None and a["step"] not in steps:
            continue
        for key in ("loss", "grad_norm"):
            diff = _rel(a[key], e[key])
            if diff > worst[key][0] or math.isnan(diff):
                worst[key] = (diff, a["step"])
    for name, e in expected.weights.items():
        a = actual.weights[name]
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, a.dtype, e.shape, e.dtype)
        diff = float((a.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30))
        if diff > worst["weights"][0] or math.isnan(diff):
            worst["weights"] = (diff, name)
    return Spread(*worst["loss"], *worst["grad_norm"], *worst["weights"])


def compare_runs(
    actual: RunResult,
    expected: RunResult,
    *,
    rel: float,
    weights_rel: float | None = None,
    steps: range | None = None,
) -> Spread:
    """Assert `actual` matches `expected`: every step's loss and grad norm within `rel`, every final
    weight tensor within `weights_rel` (default `rel`); rel=0 asks for bit-identical runs.

    Returns the measured spread; raises AssertionError naming what was off, and by how much.
    """
    weights_rel = rel if weights_rel is None else weights_rel
    found = spread(actual, expected, steps=steps)
    if rel == 0 and weights_rel == 0:
        off = [f"step {a['step']} {key}: {a[key]!r} != {e[key]!r}"
               for a, e in zip(actual.records, expected.records, strict=True)
               if steps is None or a["step"] in steps
               for key in ("loss", "grad_norm", "lr") if a[key] != e[key]]  # fmt: skip
        off += [
            f"weight {n} differs"
            for n, e in expected.weights.items()
            if not torch.equal(actual.weights[n], e)
        ]
        assert not off, "runs are not bit-identical: " + "; ".join(off[:8])
        return found
    off = []
    if not found.loss <= rel:
        off.append(f"loss off by {found.loss:.2e} at step {found.loss_step}")
    if not found.grad_norm <= rel:
        off.append(f"grad_norm off by {found.grad_norm:.2e} at step {found.grad_norm_step}")
    if not found.weights <= weights_rel:
        off.append(f"weight {found.weights_name} off by {found.weights:.2e}")
    assert not off, f"runs differ beyond rel={rel:g}, weights_rel={weights_rel:g}: " + "; ".join(off)
    return found


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


# ---------------------------------------------------------------------------------------- forked runs


def train(nproc: int, args: list[str], timeout: float = 300) -> RunResult:
    """Train the quickstart forked from this process (nproc 1: a plain process without a process
    group, the one-process reference) and return its records and final weights."""
    if nproc == 1:
        weights = run_forked(train_and_gather, list(args), timeout=timeout)
    else:
        merged: dict[str, torch.Tensor] = {}
        for rank_weights in run_distributed(train_and_gather, nproc, list(args), timeout=timeout):
            merged.update(rank_weights)  # pipeline stages hold different names; replicas equal ones
        weights = merged
    run_dir = _run_dir(args)
    return RunResult(records(run_dir), weights)


def run_forked(
    fn: Callable[..., Any], *args: Any, timeout: float = 300, env: Mapping[str, str] | None = None
) -> Any:
    """`fn(*args)` in one forked process with no process group and no torchrun variables; its result."""
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(
        target=_forked_main, args=(fn, args, dict(env or {}), writer), daemon=True
    )
    process.start()
    writer.close()
    try:
        if not reader.poll(timeout):
            raise AssertionError(f"forked {fn.__name__} did not finish within {timeout} s")
        status, payload = pickle.loads(reader.recv_bytes())
    except EOFError:
        process.join(5)
        raise AssertionError(f"forked {fn.__name__} died with exit code {process.exitcode}") from None
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
    assert status == "ok", f"forked {fn.__name__} failed:\n{payload}"
    return payload


def _forked_main(fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], writer: Any) -> None:
    try:
        for name in _DIST_ENV:
            os.environ.pop(name, None)
        os.environ.update({"OMP_NUM_THREADS": "1", **env})
        torch.set_num_threads(1)
        message = ("ok", fn(*args))
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        writer.send_bytes(pickle.dumps(message))
        writer.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def train_and_gather(args: list[str]) -> dict[str, torch.Tensor]:
    """Train (resuming if the run has checkpoints; exporting if export.dir is set); this rank's
    full-tensor view of its weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
        if any(arg.startswith("export.dir=") and arg != "export.dir=null" for arg in args):
            trainer.export()  # as the quickstart's main() does
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {name: t.detach().cpu().clone() for name, t in state.items()}


def train_counting_casts(save: str, sets: list[str], today: bool = False) -> dict[str, Any]:
    """Train the bfloat16 quickstart (TINY, run "casts", no periodic save) under `_dispatch.ParamCasts`:
    this rank's casts per parameter over the run, their bytes, its records and final weights, and the
    parameters a step casts (DDP: every one; otherwise all but the embedding table). `today`: the
    path before weights were cast once per step (the step's scope off, DDP resharding after every
    backward), in this process only: call it forked."""
    import contextlib

    from _dispatch import ParamCasts

    if today:
        from torch.distributed.fsdp import FSDPModule

        import d9d.trainer.step.base as step_base

        step_base.weights_cast_once = lambda enabled=True: contextlib.nullcontext()  # type: ignore[assignment]
        FSDPModule.set_reshard_after_backward = lambda self, *a, **k: None  # type: ignore[method-assign]
    args = [*TINY, "trainer.precision.param_dtype=bfloat16", "trainer.checkpointing.period_steps=0",
            "trainer.run.name=casts", f"trainer.checkpointing.save_dir={save}", *sets]  # fmt: skip
    with Trainer.from_config(CONFIG, args) as trainer:
        casts = ParamCasts(trainer.model)
        with casts:
            trainer.train()
        weights = {n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                   for n, p in trainer.model.named_parameters()}  # fmt: skip
    ddp = "mesh.data_parallel_replicate=2" in sets
    return {"counts": dict(casts.counts), "bytes": casts.bytes, "weights": weights,
            "records": [(r["loss"], r["grad_norm"]) for r in records(Path(save) / "casts")],
            "params": {n for n in weights if ddp or not n.endswith("embed_tokens.weight")}}  # fmt: skip


def train_counting_float8_scales(save: str, sets: list[str], precompute: bool = True) -> dict[str, Any]:
    """Train the quickstart with `sets` (a float8 job; run "f8", no periodic save) under
    `_dispatch.Float8ScaleReductions`: this rank's scale reductions, the weights FSDP2 gathers in
    float8, the losses and the final weights. `precompute=False`: the path before (each all-gather
    reduces its weights' amax), in this process only: call it forked."""
    from _dispatch import Float8ScaleReductions
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import d9d.trainer.step.base as step_base
    from d9d.parallel import float8_gathered_weights

    if not precompute:
        step_base.precompute_float8_scales = lambda model: None  # type: ignore[assignment]
    args = [
        *sets,
        "trainer.run.name=f8",
        "trainer.checkpointing.period_steps=0",
        f"trainer.checkpointing.save_dir={save}",
    ]
    with Trainer.from_config(CONFIG, args) as trainer:
        counted = Float8ScaleReductions()
        with counted:
            losses = trainer.train().losses
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {"per_weight": counted.per_weight, "all_weights": counted.all_weights, "losses": losses,
                "gathered": float8_gathered_weights(trainer.model),
                "weights": {n: t.detach().clone() for n, t in state.items()}}  # fmt: skip


def build_error(args: list[str]) -> str:
    """Build the quickstart job (and close it) in this process: "Type: message" of what it raised, or
    "no error". Call it in forked ranks (`run_distributed`, `run_forked`), never in the test process."""
    try:
        Trainer.from_config(CONFIG, args).close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _run_dir(args: list[str]) -> Path:
    found = {}
    for arg in args:
        key, _, value = arg.partition("=")
        found[key] = value
    return Path(found["trainer.checkpointing.save_dir"]) / found["trainer.run.name"]


def second_steps(root: str, variants: list[list[str]], name: str) -> Iterator[tuple[Any, Callable[[], Any]]]:
    """Per variant, its `Trainer` (one after the other in this process) after a first optimizer step (a
    warm-up: the pipeline schedule infers its shapes there) and its second step, to run."""
    from d9d.trainer import Trainer

    for i, args in enumerate(variants):
        sets = [*args, f"trainer.checkpointing.save_dir={root}/{i}", f"trainer.run.name={name}"]
        with Trainer.from_config(CONFIG, sets) as trainer:
            batches = iter(trainer.data)
            trainer.train_step.run(next(batches), 1)
            yield trainer, functools.partial(trainer.train_step.run, next(batches), 2)


def saved_activation_peaks(root: str, variants: list[list[str]]) -> list[int]:
    """This rank's peak of bytes held saved for backward (`d9d.parallel.SavedActivations`: weights and
    their compute copies left out) during the second optimizer step of each variant's job."""
    from d9d.parallel import SavedActivations

    peaks = []
    for trainer, step in second_steps(root, variants, "acts"):
        with SavedActivations(exclude=trainer.model.parameters()) as saved:
            step()
        peaks.append(saved.peak)
    return peaks


def planned_activations(variants: list[list[str]], world: int) -> list[list[int]]:
    """Per variant, every rank's planned activation bytes (`plan_job` on each rank's planning context,
    on the CPU: the dtype the variant sets)."""
    from d9d.mesh import DistributedContext
    from d9d.trainer import load_job_config, resolve_job
    from d9d.trainer.planning import plan_job

    figures = []
    for args in variants:
        job = resolve_job(load_job_config(CONFIG, args))
        per_rank = []
        for rank in range(world):
            with DistributedContext.for_planning(job.config.mesh, rank=rank) as ctx:
                plan = plan_job(job, ctx, device="cpu", memory=True)
            assert plan.memory is not None and plan.memory.activations is not None, plan.memory
            per_rank.append(plan.memory.activations.checkpointed)
        figures.append(per_rank)
    return figures
