"""CPU offload through the trainer (`trainer.memory.cpu_offload`): FSDP2's offload policy on every unit.

On CPU there is no device to offload from, so a run with offload must equal the run without it bit for
bit (FSDP2 takes its offload code paths: host gradients, the host optimizer step, the copy before each
all-gather): FSDP 2, HSDP 2×2 and TP 2 × FSDP 2 after 3 steps. What offload moves is counted exactly
by FSDP2's own account of each unit (`d9d.parallel.fsdp_parameters`): every byte of parameters,
gradients and optimizer state that a run without offload keeps on the device is kept on the host
with it, and none stays on the device. A checkpoint does not depend on it: a run saved with offload
resumes without it (and the other way round) exactly as an uninterrupted run.

What CPU cannot show (the pinned copies, the step time on a GPU) is the GPU check's; the step-time
ratio on CPU and the bytes per lever are in benchmarks/cpu_offload.py. Bad `trainer.memory` sections
are cases of the bad-input corpus (tests/bad_input/cases.yaml)."""

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, RunResult, compare_runs, overrides, records, train

from d9d.mesh.testing import run_distributed

OFFLOAD = ["trainer.memory.cpu_offload=true"]
FSDP2 = ["mesh.data_parallel_shard=2"]


def _state_bytes(trainer: Any, offloaded: bool) -> dict[str, int]:
    """This rank's local bytes of parameters, gradients and optimizer state of the parameters FSDP2
    keeps on the host (`offloaded`) or anywhere else (the device)."""
    from torch.distributed.tensor import DTensor

    from d9d.parallel import fsdp_parameters

    host = {id(p) for p in fsdp_parameters(trainer.model, offloaded=True)}
    chosen = [p for p in trainer.model.parameters() if (id(p) in host) == offloaded]

    def size(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    state = trainer.optimizer.state
    return {
        "params": sum(size(p) for p in chosen),
        "grads": sum(size(p.grad) for p in chosen),
        "optimizer": sum(size(v) for p in chosen for v in state.get(p, {}).values() if torch.is_tensor(v)),
    }


def _refusal(model: torch.nn.Module) -> str:
    """What the trainer's check of a provider's model says when `trainer.memory.cpu_offload` is set."""
    from d9d.trainer.build.model import check_offload_applied

    try:
        check_offload_applied(model, True)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _train_and_count(args: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train the quickstart; this rank's full weights, its state bytes on the host and the device, and
    what the trainer's offload check says of its model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
        counts: dict[str, Any] = {"host": _state_bytes(trainer, True), "device": _state_bytes(trainer, False)}
        counts["refusal"] = _refusal(trainer.model)
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {n: t.detach().cpu().clone() for n, t in state.items()}, counts


def _counted(save_dir: Path, name: str, *extra: str) -> tuple[RunResult, list[dict[str, Any]]]:
    args = overrides(save_dir, name, 3, *FSDP2, *extra)
    ranks = run_distributed(_train_and_count, 2, args, timeout=300)
    return RunResult(records(save_dir / name), ranks[0][0]), [counts for _, counts in ranks]


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    save_dir = tmp_path_factory.mktemp("offload")
    plain, plain_counts = _counted(save_dir, "plain")
    offloaded, offloaded_counts = _counted(save_dir, "offloaded", *OFFLOAD)
    return {"dir": save_dir, "plain": plain, "offloaded": offloaded,
            "plain_counts": plain_counts, "offloaded_counts": offloaded_counts,
            "plain_refusal": plain_counts[0]["refusal"], "offloaded_refusal": offloaded_counts[0]["refusal"]}  # fmt: skip


def test_fsdp2_with_offload_equals_fsdp2_without_bit_for_bit(fsdp2):
    compare_runs(fsdp2["offloaded"], fsdp2["plain"], rel=0)


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param(["mesh.data_parallel_replicate=2", "mesh.data_parallel_shard=2"], id="hsdp2x2"),
        pytest.param(["mesh.tensor_parallel=2", "mesh.data_parallel_shard=2"], id="tp2_fsdp2"),
    ],
)
def test_offload_on_4_ranks_equals_the_same_mesh_without_it_bit_for_bit(tmp_path, mesh):
    plain = train(4, overrides(tmp_path, "plain", 3, *mesh))
    offloaded = train(4, overrides(tmp_path, "offloaded", 3, *mesh, *OFFLOAD))
    compare_runs(offloaded, plain, rel=0)


def test_offload_keeps_every_state_byte_on_the_host_and_none_on_the_device(fsdp2):
    """Exact counts per rank after 3 steps: what FSDP2 keeps on the device without offload, it keeps on
    the host with it, and nothing of parameters, gradients or optimizer state stays on the device."""
    for plain, offloaded in zip(fsdp2["plain_counts"], fsdp2["offloaded_counts"], strict=True):
        assert all(v == 0 for v in plain["host"].values()), plain
        assert all(v == 0 for v in offloaded["device"].values()), offloaded
        assert offloaded["host"] == plain["device"], (offloaded, plain)
        device = plain["device"]
        # AdamW: exp_avg and exp_avg_sq of each parameter's shape, and a float32 step per parameter
        assert device["params"] > 0 and device["grads"] == device["params"]
        assert device["optimizer"] > 2 * device["params"]


@pytest.mark.parametrize(("first", "then"), [("on", "off"), ("off", "on")])
def test_a_checkpoint_resumes_with_offload_turned_on_or_off_as_an_uninterrupted_run(fsdp2, first, then):
    save_dir, name = fsdp2["dir"], f"resume_{first}_{then}"
    flag = {"on": OFFLOAD, "off": []}
    train(2, overrides(save_dir, name, 2, *FSDP2, *flag[first]))  # checkpoint at step 2
    resumed = train(2, overrides(save_dir, name, 3, *FSDP2, *flag[then]))
    assert [r["step"] for r in resumed.records] == [1, 2, 3]
    compare_runs(resumed, fsdp2["plain"], rel=0)


def test_the_trainer_refuses_a_provider_that_ignores_the_flag(fsdp2):
    """Sharding without `cpu_offload=context.cpu_offload` would keep the state on the device: the trainer's
    check (after the provider's parallelize_model_stage) says so in one line, of the run without offload
    (`d9d plan` refuses it with the same words: packages/d9d-cli/tests/test_plan.py)."""
    found = fsdp2["plain_refusal"]
    assert found.startswith("TrainingError: trainer.memory.cpu_offload is set but the model provider's")
    assert "pass cpu_offload=context.cpu_offload to d9d.parallel.parallelize_hsdp" in found
    assert "\n" not in found and " parameters (e.g. 'model.embed_tokens.weight')" in found, found
    assert fsdp2["offloaded_refusal"] == "no error"
