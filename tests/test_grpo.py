"""GRPO (`d9d.trainer:GRPOTask`) on the quickstart's reference model and a digit-copying task
(tests/_rl_task.py): the log-probabilities sampling returns are the training forward's; DDP 2, FSDP 2
and TP 2 give one process's rollouts, losses, grad norms, metrics and weights; a killed run resumes
bit for bit (mid-way through a generation reused for two steps); bad settings are one line."""

import json
from pathlib import Path

import pytest
from _quickstart import CONFIG, MOE, RunResult, records, train
from _rl_task import make_task
from faults._harness import kill_after_save_and_resume

HERE = Path(__file__).parent
STEPS = 4
METRICS = ("reward", "reward_std", "completion_length", "clip_fraction")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    pytest.importorskip("tokenizers")
    return make_task(tmp_path_factory.mktemp("copy"))


def _args(task: Path, save: Path, name: str, *extra: str) -> list[str]:
    return [
        "providers.dataset=d9d.trainer:PromptDatasetProvider",
        "providers.task=d9d.trainer:GRPOTask",
        f"dataset={{path: {task / 'prompts.jsonl'}, max_prompt_len: 8, tokenizer: {task / 'tokenizer'}}}",
        f"rl={{reward: {HERE / '_rl_task.py'}:copy_match, group_size: 4, max_new_tokens: 3}}",
        "model={vocab_size: 13, hidden_size: 64, intermediate_size: 128, num_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2}",
        "data.global_batch_size=8",
        "data.microbatch_size=2",
        # SGD: AdamW turns reduction-order noise of near-zero gradient entries into whole-lr steps
        # (measured, TP 2 under AdamW: an up_proj 1.04e-5 apart relative after 4 steps)
        "optimizer={name: sgd, lr: 0.1, weight_decay: 0.0}",
        "lr_scheduler={name: constant}",
        "trainer.gradient_clipping.max_norm=null",
        "trainer.logging.period_steps=1",
        "trainer.logging.progress_bar=false",
        f"trainer.checkpointing.save_dir={save}",
        "trainer.checkpointing.period_steps=2",
        f"trainer.run.name={name}",
        f"trainer.schedule.total_steps={STEPS}",
        *extra,
    ]


def _samples(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((run_dir / "rollouts").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def one_process(task_dir, tmp_path_factory) -> tuple[RunResult, Path]:
    save = tmp_path_factory.mktemp("one")
    return train(1, _args(task_dir, save, "one")), save / "one"


def test_first_step_ratio_is_one_and_the_run_logs_rollouts(one_process):
    result, run_dir = one_process
    first = result.records[0]
    assert first["clip_fraction"] == 0  # sampling's log-probabilities are the forward's: ratio 1
    assert 0 <= first["reward"] <= 1 and 1 <= first["completion_length"] <= 3
    samples = _samples(run_dir)
    assert len(samples) == 4 * STEPS and {s["step"] for s in samples} == set(range(1, STEPS + 1))
    assert all(s["prompt"].endswith(">") for s in samples)


MESHES = {
    "ddp2": ["mesh.data_parallel_replicate=2"],
    "fsdp2": ["mesh.data_parallel_shard=2"],
    "tp2": ["mesh.tensor_parallel=2"],
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_equals_one_process(task_dir, tmp_path, one_process, mesh):
    """The same prompts on other ranks sample the same completions (a prompt's generator is keyed by
    its index and the step, not the rank): the rollouts match, then every step's numbers do."""
    reference, ref_dir = one_process
    result = train(2, _args(task_dir, tmp_path, mesh, *MESHES[mesh]))
    assert _samples(tmp_path / mesh) == _samples(ref_dir)  # the same completions, rewards, advantages
    _same_run(result, reference, rel=1e-5)


def test_prompts_of_several_lengths_on_fsdp_equal_one_process(tmp_path):
    """Prompts of 1 to 3 digits: each rank samples a batch per prompt length, ranks with fewer lengths
    sample again and discard it (FSDP gathers in every forward): one process's numbers."""
    task = make_task(tmp_path / "mixed", prompts=64, digits=(1, 3), seed=1)
    one = train(1, _args(task, tmp_path, "mixed-one", "trainer.schedule.total_steps=2"))
    fsdp = train(2, _args(task, tmp_path, "mixed-fsdp2", "trainer.schedule.total_steps=2",
                          "mesh.data_parallel_shard=2"))  # fmt: skip
    assert _samples(tmp_path / "mixed-fsdp2") == _samples(tmp_path / "mixed-one")
    _same_run(fsdp, one, rel=1e-5)


def test_moe_routing_replay_on_fsdp2_ep2_equals_one_process(task_dir, tmp_path):
    """MoE layers with `rl.replay_routing`: sampling records each token's experts and the training
    forward routes it there (two optimizer steps per generation, the second on moved weights: there
    the routers alone would choose otherwise). The first step's ratio is 1, and FSDP 2 × EP 2 takes
    one process's steps; each generation samples with the routers' own choice (the step clears the
    replay)."""
    extra = [*MOE, "rl.replay_routing=true", "rl.iterations=2"]
    one = train(1, _args(task_dir, tmp_path, "moe-one", *extra))
    assert one.records[0]["clip_fraction"] == 0
    # without replay: step 1 (the sampling weights) routes alike, step 2 (moved routers) does not
    own = train(1, _args(task_dir, tmp_path, "moe-own", *MOE, "rl.iterations=2"))
    assert own.records[0]["loss"] == one.records[0]["loss"]
    assert own.records[1]["loss"] != one.records[1]["loss"]  # measured: -0.08382 against -0.08400
    ep = train(
        2,
        _args(task_dir, tmp_path, "moe-ep2", *extra, "mesh.data_parallel_shard=2", "mesh.expert_parallel=2"),
    )
    assert _samples(tmp_path / "moe-ep2") == _samples(tmp_path / "moe-one")
    _same_run(ep, one, rel=1e-5)


def _same_run(actual: RunResult, expected: RunResult, rel: float) -> None:
    """Every step's loss (absolutely: a policy-gradient loss sits near 0), grad norm and metric, and the
    final weights (per tensor, relative to its norm), within `rel`."""
    assert len(actual.records) == len(expected.records)
    for mine, one in zip(actual.records, expected.records, strict=True):
        assert mine["loss"] == pytest.approx(one["loss"], abs=rel), ("loss", mine["step"])
        for key in ("grad_norm", *METRICS):
            assert mine[key] == pytest.approx(one[key], rel=rel, abs=1e-7), (key, mine["step"])
    for name, value in expected.weights.items():
        off = float((actual.weights[name] - value).norm() / value.norm().clamp(min=1e-12))
        assert off <= rel, (name, off)


def test_killed_run_resumes_bit_exact_mid_way_through_a_generation(task_dir, tmp_path):
    """Two optimizer steps per generation (`rl.iterations: 2`), a checkpoint after step 3 (the first of
    its generation's two): the resumed run takes step 4 on the checkpoint's rollouts, then samples
    step 5's from the same seeds: every record as the uninterrupted run's, bit for bit."""
    steps = 6
    extra = [
        "rl.iterations=2",
        "trainer.checkpointing.period_steps=3",
        f"trainer.schedule.total_steps={steps}",
    ]
    full = train(1, _args(task_dir, tmp_path, "full", *extra))
    args = _args(task_dir, tmp_path, "killed", *extra)
    kill_after_save_and_resume(tmp_path / "killed", args, steps, save_step=3, config=CONFIG,
                               killed_env={"D9D_TEST_HANG_AT_STEP": "4"})  # fmt: skip
    resumed = records(tmp_path / "killed")
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    keys = ("loss", "grad_norm", *METRICS)
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in full.records]
    assert full.records[3]["clip_fraction"] >= 0 and full.records[3]["reward"] == full.records[2]["reward"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            [f"rl={{reward: {HERE / '_rl_task.py'}:copy_match, group_size: 1}}"],
            r"rl\.group_size must be >= 2",
        ),
        (
            [f"rl={{reward: {HERE / '_rl_task.py'}:copy_match, max_new_tokens: 0}}"],
            r"rl\.max_new_tokens must be >= 1",
        ),
        (["rl={reward: no_such_file.py:reward}"], r"rl\.reward.*no file"),
        ([f"rl={{reward: {HERE / '_rl_task.py'}:no_such_name}}"], r"no_such_name"),
        (
            ["eval={period_steps: 2}", "providers.eval_dataset=d9d.trainer:PromptDatasetProvider"],
            r"has no eval loss.*remove the eval: section",
        ),
    ],
    ids=["group-size", "completion-budget", "reward-file", "reward-name", "eval"],
)
def test_bad_rl_settings_are_one_line_before_anything_is_built(task_dir, tmp_path, extra, message):
    from d9d.trainer import ConfigError, load_job_config, resolve_job

    with pytest.raises(ConfigError, match=message) as caught:
        args = _args(task_dir, tmp_path, "bad", *extra)
        if any(a.startswith("providers.eval_dataset") for a in extra):
            args.append(f"eval_dataset={{path: {task_dir / 'prompts.jsonl'}, max_prompt_len: 8}}")
        resolve_job(load_job_config(CONFIG, args))
    assert "\n" not in str(caught.value)


def test_bad_rewards_and_prompts_stop_the_run_with_one_line(task_dir, tmp_path):
    from _quickstart import run_main

    wrong = run_main(_args(task_dir, tmp_path, "wrong", f"rl.reward={HERE / '_rl_task.py'}:wrong_length"))
    assert wrong.returncode != 0
    assert "rl.reward" in wrong.stderr and "one finite number per completion" in wrong.stderr
    long = run_main(_args(task_dir, tmp_path, "long", "dataset.max_prompt_len=2"))
    assert long.returncode != 0 and "more than max_prompt_len=2" in long.stderr
    assert not (tmp_path / "long").exists()  # refused while the data was built, before any file


def _peak_and_plan(args: list[str], seq_len: int) -> tuple[int, int]:
    """(the peak bytes saved for backward over a whole GRPO run, the plan's activations at `seq_len`)."""
    from d9d.mesh import DistributedContext
    from d9d.parallel import SavedActivations
    from d9d.trainer import Trainer, load_job_config, resolve_job
    from d9d.trainer.planning import plan_job

    job = resolve_job(load_job_config(CONFIG, args))
    with DistributedContext.for_planning(job.config.mesh, rank=0) as ctx:
        plan = plan_job(job, ctx, device="cpu", memory=True, seq_len=seq_len)
    assert plan.memory is not None and plan.memory.activations is not None, plan.memory
    with (
        Trainer.from_config(CONFIG, args) as trainer,
        SavedActivations(exclude=trainer.model.parameters()) as saved,
    ):
        trainer.train()
    return saved.peak, plan.memory.activations.checkpointed


def test_the_plan_estimates_a_grpo_steps_activations(task_dir, tmp_path):
    """`d9d plan --seq-len` shapes a GRPO microbatch as the rollouts are (`ShapesBatch`: `group_size`
    rows per prompt) and runs the task's loss on it: its activations are those the widest rollout
    microbatch (prompt 3 + 3 new tokens) keeps saved for backward. Measured: within 4 bytes."""
    from _quickstart import run_forked

    peak, planned = run_forked(
        _peak_and_plan, _args(task_dir, tmp_path, "plan", "trainer.schedule.total_steps=2"), 6
    )
    assert peak > 0 and abs(planned - peak) <= max(8, peak // 100), (planned, peak)
