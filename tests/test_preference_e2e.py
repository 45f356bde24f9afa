"""Preference optimization end to end on the example's demo (a tiny Qwen3 folder and conversational
pairs): DPO equals TRL's DPOTrainer on the same folder and pairs (losses, gradient norms, rewards);
every mesh equals one process (losses, gradient norms, metrics, weights); a killed run resumes bit for
bit; packed pairs score exactly as unpacked ones; LoRA's reference is the base model."""

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _quickstart import records, run_forked

from d9d.mesh.testing import run_distributed

STEPS = 3
PAIRS = 8
#: The example's config, cut to a few whole-set steps of 8 pairs, every step and eval recorded.
SMALL = [
    f"trainer.schedule.total_steps={STEPS}",
    "trainer.logging.period_steps=1",
    "trainer.logging.progress_bar=false",
    "trainer.checkpointing.period_steps=100",
    f"data.global_batch_size={PAIRS}",
    "data.microbatch_size=4",
    "data.shuffle=false",
    "lr_scheduler={name: constant}",
    "optimizer={name: adamw, lr: 1.0e-3, betas: [0.9, 0.999], eps: 1.0e-8, weight_decay: 0.0}",
    "eval.period_steps=0",
    "export.dir=null",
]
METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")  # fmt: skip


def _subset(example: Path, pairs: int = PAIRS) -> Path:
    """The first `pairs` training pairs of the demo, as their own file (every step sees all of them)."""
    path = example / "demo" / "pairs" / f"first{pairs}.jsonl"
    if not path.exists():
        lines = (example / "demo" / "pairs" / "train.jsonl").read_text().splitlines()[:pairs]
        path.write_text("\n".join(lines) + "\n")
    return path


def _args(example: Path, name: str, *extra: str) -> list[str]:
    return [*SMALL, f"dataset.path={_subset(example)}", f"trainer.run.name={name}", *extra]


def _train(config: str, args: list[str]) -> dict[str, Any]:
    """Train; the full weights afterwards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config, args) as trainer:
        trainer.train()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {name: tensor.detach().clone() for name, tensor in state.items()}


def _steps(run_dir: Path) -> list[dict[str, float]]:
    return [{key: r[key] for key in METRICS} for r in records(run_dir) if "loss" in r]


BACKENDS = {"reference": [], "hf": ["model.backend=hf"]}


@pytest.fixture(scope="module", params=list(BACKENDS))
def one_process(
    request, preference_example: Path
) -> tuple[str, list[dict[str, float]], dict[str, torch.Tensor]]:
    """The example cut small on one process, on the reference model (`model.backend: auto` picks it for
    this folder) and on transformers' model (`hf`)."""
    example, backend = preference_example, request.param
    name = f"one-{backend}"
    weights = run_forked(_train, str(example / "config.yaml"), _args(example, name, *BACKENDS[backend]),
                         env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    return backend, _steps(example / "runs" / name), weights


def _trl_dpo(example: Path, steps: int, loss: str = "sigmoid") -> list[dict[str, float]]:
    """TRL's DPOTrainer on the same folder and pairs, with the same optimizer, on CPU in float32."""
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer

    folder = str(example / "demo" / "model")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pairs = datasets.load_dataset("json", data_files=str(_subset(example)), split="train")
    args = DPOConfig(
        output_dir=str(example / "runs" / "trl"), per_device_train_batch_size=PAIRS, max_steps=steps,
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, bf16=False, fp16=False,
        use_cpu=True, beta=0.1, loss_type=[loss], max_length=128, report_to=[], save_strategy="no",
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=pairs, processing_class=tokenizer
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [{key: float(entry[key]) for key in METRICS} for entry in logged]


def test_dpo_matches_trl(preference_example: Path, one_process) -> None:
    """Same folder, same pairs, same optimizer: TRL's and d9d's DPO agree step by step (fp32, CPU), on
    both backends. Measured (reference backend): loss within 3.6e-7, grad norm 2.1e-6, margins 1.6e-6."""
    pytest.importorskip("trl")
    _, ours, _ = one_process
    theirs = run_forked(_trl_dpo, preference_example, STEPS, env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert len(ours) == len(theirs) == STEPS
    assert ours[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # step 1: the policy is the reference
    for step, (mine, trl) in enumerate(zip(ours, theirs, strict=True), start=1):
        for key in METRICS:
            assert mine[key] == pytest.approx(trl[key], rel=1e-4, abs=1e-4), (step, key, mine[key], trl[key])
    assert ours[-1]["rewards/margins"] > 0  # it learned: the chosen completions gained on the rejected


def test_ipo_matches_trl(preference_example: Path) -> None:
    """IPO (`preference.loss: ipo`, per-token log-ratios as TRL's) against TRL's `loss_type=["ipo"]`."""
    pytest.importorskip("trl")
    example = preference_example
    run_forked(_train, str(example / "config.yaml"), _args(example, "ipo", "preference.loss=ipo"),
               env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    ours = _steps(example / "runs" / "ipo")
    theirs = run_forked(_trl_dpo, example, STEPS, "ipo", env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert ours[0]["loss"] == pytest.approx(1 / (2 * 0.1) ** 2, rel=1e-6)  # step 1: (0 − 1/(2β))²
    for step, (mine, trl) in enumerate(zip(ours, theirs, strict=True), start=1):
        for key in METRICS:
            assert mine[key] == pytest.approx(trl[key], rel=1e-4, abs=1e-4), (step, key, mine[key], trl[key])


MESHES = {"reference": ["mesh.data_parallel_shard=2"], "hf": ["mesh.tensor_parallel=2"]}
#: SGD for the mesh comparison: AdamW turns the reduction-order noise of near-zero gradient entries into
#: whole-lr steps (measured, TP 2 on hf after 3 steps: a q_proj 9.5e-6 apart relative under AdamW,
#: 4e-8 under SGD), which would test Adam's normalization rather than the mesh.
SGD = "optimizer={name: sgd, lr: 0.1, weight_decay: 0.0}"


@pytest.mark.parametrize("backend", list(MESHES))
def test_the_example_on_two_ranks_equals_one_process(preference_example: Path, backend: str) -> None:
    """FSDP 2 on the reference model, TP 2 on transformers' model: every step's loss, grad norm and
    metric, and the final weights, as one process (the other meshes: tests/test_preference_meshes.py)."""
    example, config = preference_example, str(preference_example / "config.yaml")
    one = f"sgd-one-{backend}"
    ref_weights = run_forked(_train, config, _args(example, one, *BACKENDS[backend], SGD),
                             env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    name = f"sgd-two-{backend}"
    args = _args(example, name, *BACKENDS[backend], SGD, *MESHES[backend])
    results = run_distributed(_train, 2, config, args, timeout=300)
    for mine, ref in zip(_steps(example / "runs" / name), _steps(example / "runs" / one), strict=True):
        for key in METRICS:
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-5), (
                backend,
                key,
                mine[key],
                ref[key],
            )
    for weights in results:
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-5, msg=f"{backend}: {name}")


def test_reward_model_exports_for_transformers_with_its_eval_numbers(preference_example: Path) -> None:
    """The reward example (`reward.yaml`: a one-label score head, the Bradley-Terry loss): its export
    loads in transformers' AutoModelForSequenceClassification, whose scores of the held-out pairs give
    d9d's last eval exactly: the mean Bradley-Terry loss, the margins and the pairwise accuracy."""
    import transformers

    from d9d.data import PreferenceDataset, collate_preference

    example = preference_example
    args = ["trainer.schedule.total_steps=4", "trainer.logging.progress_bar=false", "eval.period_steps=0",
            "trainer.run.name=reward-e2e", "export.dir=export-reward-e2e"]  # fmt: skip
    run_forked(_train_and_export, str(example / "reward.yaml"), args, env={"OMP_NUM_THREADS": "1"})
    last = records(example / "runs" / "reward-e2e")[-1]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        example / "export-reward-e2e", dtype=torch.float32
    )
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    val = PreferenceDataset(
        example / "demo" / "pairs" / "val.jsonl", 128, tokenizer=example / "demo" / "model"
    )
    batch = collate_preference([val[i] for i in range(len(val))])
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"]).logits.view(-1, 2).double()
    margins = scores[:, 0] - scores[:, 1]
    assert last["eval_loss"] == pytest.approx(
        float(-torch.nn.functional.logsigmoid(margins).mean()), rel=1e-5
    )
    assert last["eval_rewards/margins"] == pytest.approx(float(margins.mean()), rel=1e-5)
    assert last["eval_rewards/chosen"] == pytest.approx(float(scores[:, 0].mean()), rel=1e-5, abs=1e-6)
    assert last["eval_rewards/accuracies"] == float((margins > 0).double().mean())


def _train_and_export(config: str, args: list[str]) -> None:
    from d9d.trainer import Trainer

    with Trainer.from_config(config, args) as trainer:
        trainer.train()
        trainer.export()


def test_simpo_first_step_is_the_paper_formula_on_transformers_log_probs(preference_example: Path) -> None:
    """SimPO (reference-free; TRL's DPOTrainer has no such loss): the first step's loss equals
    mean −log σ(β·(mean log π(y_c) − mean log π(y_r)) − γ) over the pairs, with each completion's
    per-token mean log-probability computed here by transformers' model on the same tokens."""
    import transformers

    from d9d.data import PreferenceDataset, collate_preference

    example = preference_example
    beta, gamma = 2.0, 0.5
    run_forked(_train, str(example / "config.yaml"),
               _args(example, "simpo", f"preference={{loss: simpo, beta: {beta}, gamma: {gamma}}}"),
               env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    first = _steps(example / "runs" / "simpo")[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(example / "demo" / "model", dtype=torch.float32)
    pairs = PreferenceDataset(_subset(example), 128, tokenizer=example / "demo" / "model")
    batch = collate_preference([pairs[i] for i in range(len(pairs))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.double()
    labels = batch["labels"]
    mask = labels != -100
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    means = (picked * mask).sum(-1) / mask.sum(-1)  # a row per sequence: chosen, rejected, chosen, ...
    chosen, rejected = means.view(-1, 2).unbind(-1)
    expected = -torch.nn.functional.logsigmoid(beta * (chosen - rejected) - gamma).mean()
    assert first["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert first["rewards/margins"] == pytest.approx(
        float(beta * (chosen - rejected).mean()), rel=1e-4, abs=1e-5
    )
