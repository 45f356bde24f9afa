"""A LoRA job's plan counts what trains: the adapters' gradients and optimizer state, not the frozen
base's (it used to plan a full fine-tune), checked against the model and optimizer the trainer builds,
on one process and per rank of FSDP 2; the "job built" line says the trainable count and what each
pattern matched."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.mesh import DistributedContext
from d9d.mesh.testing import run_distributed
from d9d.parallel import lora_parameters, optimizer_state_bytes
from d9d.trainer import Trainer, load_job_config, resolve_job
from d9d.trainer.planning import FIT_HEADROOM, plan_config, plan_fit, plan_job

#: Adapters on each block's two linears (the tiny model: blocks.<i>.up, blocks.<i>.down and a head).
LORA = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": [r"blocks\.\d+\.(up|down)"]}}


def _config(tmp_path: Path, **extra: object) -> dict:
    config = job_config(str(tmp_path / "runs"), total_steps=1, peft=LORA, **extra)
    config["providers"]["model"] = "_job:LoraModelProvider"
    return config


def _nbytes(params: list[torch.Tensor]) -> int:
    """Bytes of this rank's share of `params`."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in params)


def test_the_plan_of_a_lora_job_counts_grads_and_optimizer_state_of_the_adapters_only(tmp_path, capsys):
    job = resolve_job(load_job_config(_config(tmp_path)))
    plan = plan_job(job, DistributedContext.from_env(environ={}, device="cpu"), memory=True)
    with Trainer(job) as trainer:
        trainer.train()
        model = trainer.model
        adapters = lora_parameters(model)  # found by module type, not by requires_grad
        built = {
            "params": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "adapters": sum(p.numel() for p in adapters),
            "bytes": _nbytes(list(model.parameters())),
            "adapter_bytes": _nbytes(adapters),
            "optimizer": optimizer_state_bytes(trainer.optimizer),
        }
    memory = plan.memory
    assert memory is not None
    assert built["adapter_bytes"] * 4 < built["bytes"]  # a full fine-tune's figures would be far off
    assert memory.trainable_parameters == built["trainable"] == built["adapters"]
    assert memory.parameters == built["params"]  # the adapters are parameters too
    assert (memory.param_bytes, memory.trainable_bytes) == (built["bytes"], built["adapter_bytes"])
    state = memory.state
    assert (state.params, state.grads) == (built["bytes"], built["adapter_bytes"])
    assert state.optimizer == built["optimizer"] == 2 * built["adapter_bytes"]  # AdamW's two moments
    assert memory.lora is not None and memory.lora.warning() is None
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "job built" in line]
    assert f"params={built['params']} " in line and f"trainable_params={built['trainable']} " in line
    assert r"lora_targets='blocks\.\d+\.(up|down): 2 in each of 2 layers'" in line  # the regex as written


def test_the_fit_levers_of_a_lora_job_re_plan_what_trains(tmp_path):
    loaded = load_job_config(_config(tmp_path, dataset={"seq_len": 64}))
    plan = plan_config(loaded, device="cpu")
    memory = plan.memory
    assert memory is not None and memory.activations is not None
    fit = plan_fit(plan, loaded, int(memory.total * 0.99 / FIT_HEADROOM))  # just too big
    levers = {lever.overrides: lever for lever in fit.levers}
    adapters = memory.trainable_bytes
    # bf16 states halve the adapters' AdamW state only: 2 states × 2 of their 4 bytes an element
    assert levers[("optimizer.state_dtype=bfloat16",)].total == memory.total - adapters
    full = levers[("trainer.activation_checkpointing.mode=full",)].total
    acts = memory.activations
    recompute = (acts.plain - acts.full) // 2  # one of the 2 checkpointed layers, recomputed in backward
    assert full == memory.device_state + acts.full + recompute


def _fsdp_rank(config: dict) -> dict:
    """On one rank of FSDP 2: the trainer's shares of the parameters and optimizer state after a step,
    and the plan of the same rank."""
    with Trainer.from_config(config) as trainer:
        trainer.train()
        model = trainer.model
        plan = plan_job(resolve_job(load_job_config(config)), trainer.context, memory=True)
        assert plan.memory is not None
        return {
            "params": _nbytes(list(model.parameters())),
            "adapters": _nbytes(lora_parameters(model)),
            "optimizer": optimizer_state_bytes(trainer.optimizer),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "planned": plan.memory.state,
            "planned_trainable": plan.memory.trainable_parameters,
            "activations": plan.memory.activations,
        }


def test_per_rank_of_fsdp_2_the_plan_holds_the_adapters_shares_of_grads_and_optimizer_state(tmp_path):
    config = _config(tmp_path, mesh={"data_parallel_shard": 2})
    for rank in run_distributed(_fsdp_rank, 2, config):
        planned = rank["planned"]
        assert planned.shard_factor == 2
        assert (planned.params, planned.grads) == (rank["params"], rank["adapters"])
        assert planned.optimizer == rank["optimizer"] == 2 * rank["adapters"]
        assert rank["planned_trainable"] == rank["trainable"]  # a DTensor counts its global size
        assert rank["activations"] is not None  # a real rank's plan (d9d preflight's) estimates them
