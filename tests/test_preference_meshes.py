"""Preference optimization (`d9d.trainer:PreferenceTask`) on every mesh equals one process, on the
quickstart's reference model and synthetic pairs (tests/_pairs_provider.py): every step's loss, grad
norm and metrics (rewards, margins, accuracy, log-probs, reduced over the data-parallel ranks), every
eval's metrics over the whole held-out set, and the final weights; packed pairs score as unpacked ones;
a killed run resumes bit for bit, its reference log-probabilities read back from the checkpoint."""

from pathlib import Path

import pytest
from _quickstart import CONFIG, TINY, RunResult, compare_runs, records, train
from faults._harness import kill_after_save_and_resume

PROVIDER = str(Path(__file__).parent / "_pairs_provider.py")
STEPS = 3
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")  # fmt: skip


def _args(tmp: Path, name: str, *extra: str, pack: bool = False) -> list[str]:
    return [
        *TINY,
        f"providers.dataset={PROVIDER}:PairsProvider",
        f"providers.eval_dataset={PROVIDER}:PairsProvider",
        "providers.task=d9d.trainer:PreferenceTask",
        f"dataset={{pairs: 16, seq_len: 32, seed: 1, pack: {str(pack).lower()}}}",
        f"eval_dataset={{pairs: 10, seq_len: 32, seed: 2, pack: {str(pack).lower()}}}",
        "eval={period_steps: 2}",
        "preference={loss: sigmoid, beta: 0.5}",
        "data.global_batch_size=8",
        "data.microbatch_size=2",
        "optimizer.lr=0.003",
        "trainer.gradient_clipping.max_norm=null",  # clipping would hide a gradient-scale error
        f"trainer.checkpointing.save_dir={tmp}",
        f"trainer.run.name={name}",
        f"trainer.schedule.total_steps={STEPS}",
        *extra,
    ]


@pytest.fixture(scope="module")
def one_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("one")


@pytest.fixture(scope="module")
def one_process(one_dir) -> RunResult:
    return train(1, _args(one_dir, "one"))


def _metrics(result: RunResult) -> list[dict[str, float]]:
    keys = ("loss", "grad_norm", *METRICS, *(f"eval_{m}" for m in METRICS), "eval_loss")
    return [{key: r[key] for key in keys if key in r} for r in result.records]


def _same_metrics(actual: RunResult, expected: RunResult, rel: float) -> None:
    for mine, one in zip(_metrics(actual), _metrics(expected), strict=True):
        assert mine.keys() == one.keys()
        for key, value in one.items():
            assert mine[key] == pytest.approx(value, rel=rel, abs=rel), (key, mine[key], value)


MESHES = {
    "ddp2": ["mesh.data_parallel_replicate=2"],
    "fsdp2": ["mesh.data_parallel_shard=2"],
    "tp2": ["mesh.tensor_parallel=2"],
    "pp2": ["mesh.pipeline_parallel=2"],
}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_equals_one_process(tmp_path, one_process, mesh):
    result = train(2, _args(tmp_path, mesh, *MESHES[mesh]))
    assert [r["step"] for r in result.records] == [1, 2, 3]
    assert one_process.records[1]["eval_rewards/accuracies"] is not None
    compare_runs(result, one_process, rel=1e-5)
    _same_metrics(result, one_process, rel=1e-5)


def test_first_step_compares_the_policy_with_itself(one_process):
    first = one_process.records[0]
    assert first["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)  # -log σ(0): policy = reference
    assert first["rewards/margins"] == 0 and first["rewards/accuracies"] == 0
    last = one_process.records[-1]
    assert last["rewards/margins"] > 0 and last["loss"] < first["loss"]  # it learns to prefer chosen


@pytest.mark.parametrize("mesh", ["one", "pp2"])
def test_packed_pairs_score_as_unpacked(tmp_path, mesh):
    """Chosen and rejected share rows as separate documents: the reference pass (the starting weights)
    gives every pair of both sets the log-probabilities it gets on rows of its own."""
    extra = MESHES.get(mesh, [])
    nproc = 2 if extra else 1
    train(nproc, _args(tmp_path, "packed", "trainer.schedule.total_steps=2", *extra, pack=True))
    train(nproc, _args(tmp_path, "unpacked", "trainer.schedule.total_steps=2", *extra))
    packed, unpacked = _reference_tables(tmp_path / "packed"), _reference_tables(tmp_path / "unpacked")
    assert set(packed) == set(unpacked) == {"train", "eval"}
    for role in ("train", "eval"):
        assert len(packed[role]) == 2 * (16 if role == "train" else 10)
        assert packed[role] == pytest.approx(unpacked[role], rel=1e-5, abs=1e-5)


def _reference_tables(run_dir: Path) -> dict[str, list[float]]:
    """The reference log-probabilities a run's latest checkpoint holds, by set."""
    import msgspec

    from d9d.trainer.providers.task import tensor_from_state

    latest = sorted(run_dir.glob("save-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    extra = msgspec.msgpack.decode((latest / "extra.msgpack").read_bytes())
    tables = extra["task"]["reference_logps"]
    return {role: tensor_from_state(entry).reshape(-1).tolist() for role, entry in tables.items()}


def test_killed_run_resumes_bit_exact(tmp_path):
    steps = 6
    args = _args(
        tmp_path, "killed", f"trainer.schedule.total_steps={steps}", "trainer.checkpointing.period_steps=2"
    )
    full = train(1, _args(tmp_path, "full", f"trainer.schedule.total_steps={steps}"))
    kill_after_save_and_resume(tmp_path / "killed", args, steps, save_step=2, config=CONFIG,
                               killed_env={"D9D_TEST_HANG_AT_STEP": "3"})  # fmt: skip
    resumed = RunResult(records(tmp_path / "killed"), {})
    assert [r["step"] for r in resumed.records] == list(range(1, steps + 1))
    for mine, one in zip(_metrics(resumed), _metrics(full), strict=True):
        assert mine == one  # bit for bit: losses, grad norms, rewards, evals


def test_full_logits_give_the_fused_heads_numbers(tmp_path, one_process):
    """With `trainer.loss.fused: false` the model returns logits and the task takes their log-softmax:
    the fused head's per-token losses (the default) give the same run."""
    logits = train(1, _args(tmp_path, "logits", "trainer.loss.fused=false"))
    compare_runs(logits, one_process, rel=1e-5)
    _same_metrics(logits, one_process, rel=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["preference={loss: sigmoid, beta: 0}"], r"preference\.beta must be a positive number, got 0"),
        (["preference={loss: kto}"], r"preference\.loss: Invalid enum value 'kto'"),
        (["preference={loss: sigmoid, temperature: 2}"], r"unknown key preference\.temperature"),
        (["providers.task=d9d.trainer:CausalLMTask"], r"a preference: section is given but providers\.task"),
        (["mesh.context_parallel=2"], r"does not run under context parallelism.*mesh\.context_parallel: 1"),
    ],
    ids=["beta", "loss", "unknown-key", "section-without-task", "context-parallel"],
)
def test_bad_preference_config_is_one_line_before_anything_is_built(tmp_path, extra, message):
    from d9d.trainer import ConfigError, load_job_config, resolve_job

    with pytest.raises(ConfigError, match=message) as caught:
        resolve_job(load_job_config(CONFIG, _args(tmp_path, "bad", *extra), world_size=2))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "bad").exists()


LORA = r"peft.lora={rank: 4, alpha: 8, target_modules: ['.*\.(q_proj|v_proj|up_proj)']}"


def test_lora_reference_is_the_base_model_on_fsdp_as_on_one_process(tmp_path, one_process, one_dir):
    """With LoRA the reference pass runs the base model (adapters off, no copy): the reference
    log-probabilities are the full model's starting ones; FSDP 2 trains the adapters as one process."""
    one = train(1, _args(tmp_path, "lora-one", LORA))
    fsdp = train(2, _args(tmp_path, "lora-fsdp2", LORA, "mesh.data_parallel_shard=2"))
    compare_runs(fsdp, one, rel=1e-5)
    _same_metrics(fsdp, one, rel=1e-5)
    assert one.records[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-7)
    full, lora = _reference_tables(one_dir / "one"), _reference_tables(tmp_path / "lora-one")
    for role in ("train", "eval"):
        assert lora[role] == pytest.approx(full[role], rel=1e-6)


#: A reward model: the reference model with a one-label score head, scored on the last real token.
REWARD = ["model.head={kind: classification, num_labels: 1, pad_token_id: 256}",
          "preference={loss: bradley_terry}"]  # fmt: skip


@pytest.fixture(scope="module")
def reward_one_process(tmp_path_factory) -> RunResult:
    return train(1, _args(tmp_path_factory.mktemp("reward"), "reward-one", *REWARD))


@pytest.mark.parametrize("mesh", list(MESHES))
def test_reward_model_on_every_mesh_equals_one_process(tmp_path, reward_one_process, mesh):
    """Bradley-Terry on a score head: every mesh's losses, grad norms, rewards, pairwise accuracy (step
    and eval) and weights as one process's."""
    result = train(2, _args(tmp_path, f"reward-{mesh}", *REWARD, *MESHES[mesh]))
    compare_runs(result, reward_one_process, rel=1e-5)
    _same_metrics(result, reward_one_process, rel=1e-5)


def test_reward_model_learns_and_packed_pairs_score_as_unpacked(tmp_path, reward_one_process):
    first, last = reward_one_process.records[0], reward_one_process.records[-1]
    assert "logps/chosen" not in first  # a reward model's rewards are its scores
    assert last["loss"] < first["loss"] and last["rewards/margins"] > first["rewards/margins"]
    assert last["eval_rewards/accuracies"] > 0.5
    # packed rows score each document: with the starting weights kept (SGD at lr 1e-30: below any
    # weight's ulp), the eval over the whole
    # held-out set scores every pair as on rows of its own
    frozen = ["trainer.schedule.total_steps=1", "optimizer={name: sgd, lr: 1.0e-30, weight_decay: 0.0}"]
    packed = train(1, _args(tmp_path, "reward-packed", *REWARD, *frozen, pack=True))
    unpacked = train(1, _args(tmp_path, "reward-unpacked", *REWARD, *frozen))
    for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies"):
        assert packed.records[0][key] == pytest.approx(unpacked.records[0][key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("mesh", ["one", "pp2"])
def test_the_plan_estimates_a_preference_steps_activations(mesh):
    """`d9d plan` shapes a preference microbatch as the data does (`ShapesBatch`: two rows per pair) and
    runs the task's per-token head loss on it: its activations are those a real step keeps saved for
    backward (SimPO: the same forward as DPO without the reference pass the measuring harness skips).
    Measured: within 4 bytes on one process and on both pp 2 stages."""
    from _quickstart import planned_activations, run_forked, saved_activation_peaks

    from d9d.mesh.testing import run_distributed

    world = 2 if mesh == "pp2" else 1
    variants = [[*_args(Path("/unused"), "plan", "preference={loss: simpo, beta: 2.0}", "eval=null",
                         "providers.eval_dataset=null", "trainer.schedule.total_steps=2",
                         *MESHES.get(mesh, []))]]  # fmt: skip
    planned = run_forked(planned_activations, variants, world)[0]
    if world == 1:
        measured = [run_forked(saved_activation_peaks, "/tmp/d9d-plan-pref", variants)[0]]
    else:
        measured = [
            peaks[0] for peaks in run_distributed(saved_activation_peaks, 2, "/tmp/d9d-plan-pref", variants)
        ]
    for rank, (plan, real) in enumerate(zip(planned, measured, strict=True)):
        assert real > 0 and abs(plan - real) <= max(8, real // 1000), (mesh, rank, plan, real)
