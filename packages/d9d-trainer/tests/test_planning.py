"""`plan_job`: the one plan the trainer builds from (what `d9d plan` prints is tested in d9d-cli)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.data import BatchSizeError, TextDataset
from d9d.mesh import DistributedContext
from d9d.parallel import SequenceLengthError
from d9d.trainer import ConfigError, Trainer, TrainingError, load_job_config, resolve_job
from d9d.trainer.planning import estimate_memory, plan_job
from d9d.trainer.providers import BuildDatasetResult


def _job(tmp_path, **sections):
    return resolve_job(load_job_config(job_config(str(tmp_path / "runs"), **sections)))


@pytest.mark.parametrize(
    ("sizes", "degrees", "states", "expected"),
    [
        ((8000, 6000), (2, 2, 1, 2), 2, (8, 1000, 750, 1500)),
        # FSDP shards over the flattened dp_shard × cp axis: cp divides parameters, grads and states too
        ((8000, 8000), (1, 2, 2, 2), 2, (8, 1000, 1000, 2000)),
        ((10, 10), (1, 3, 1, 1), 0, (3, 4, 4, 0)),  # rounds up; SGD without momentum has no state
    ],
    ids=["pp-dp-tp", "dp_shard-times-cp", "rounds-up"],
)
def test_the_state_estimate_divides_by_the_sharding_degrees(sizes, degrees, states, expected):
    pp, dp_shard, cp, tp = degrees
    est = estimate_memory(
        *sizes,
        pipeline_parallel=pp,
        data_parallel_shard=dp_shard,
        context_parallel=cp,
        tensor_parallel=tp,
        optimizer_states=states,
    )
    assert (est.shard_factor, est.params, est.grads, est.optimizer) == expected
    assert est.total == est.params + est.grads + est.optimizer


def test_state_bytes_replace_the_parameters_bytes_in_the_optimizer_estimate():
    # 8000 trainable float32 bytes = 2000 elements; bfloat16 states: 4000 bytes each, over 4 ranks
    est = estimate_memory(8000, 8000, pipeline_parallel=1, data_parallel_shard=2, context_parallel=1,
                          tensor_parallel=2, optimizer_states=2, state_bytes=4000)  # fmt: skip
    assert (est.params, est.grads, est.optimizer, est.optimizer_state_bytes) == (2000, 2000, 2000, 4000)


@pytest.mark.parametrize(("name", "states"), [("adamw", 2), ("sgd", 1)])
def test_the_memory_plan_counts_the_optimizer_state_the_trainer_builds_exactly(tmp_path, name, states):
    from d9d.parallel import optimizer_state_bytes

    found = {}
    for dtype in ("float32", "bfloat16"):
        optimizer = {"name": name, "lr": 1e-2, "momentum": 0.9, "state_dtype": dtype}
        job = resolve_job(
            load_job_config(job_config(str(tmp_path / dtype), total_steps=1, optimizer=optimizer))
        )
        plan = plan_job(job, DistributedContext.from_env(environ={}, device="cpu"), memory=True)
        with Trainer(job) as trainer:
            trainer.train()
            built = optimizer_state_bytes(trainer.optimizer)
        assert plan.memory is not None and plan.memory.state.optimizer == built, dtype
        assert plan.optimizer_states.dtype == (torch.bfloat16 if dtype == "bfloat16" else None)
        found[dtype] = built
    numel = plan.memory.trainable_bytes // 4
    assert found == {"float32": 4 * states * numel, "bfloat16": 2 * states * numel}


def test_a_local_plan_holds_the_declared_batching_precision_and_optimizer_state(tmp_path):
    job = _job(tmp_path, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9})
    plan = plan_job(
        job,
        DistributedContext.from_env(environ={}, device="cpu"),
        dataset=BuildDatasetResult(dataset=[], vocab_size=64),
    )
    assert plan.batching is not None
    assert (plan.batching.global_batch_size, plan.batching.microbatches_per_step) == (8, 4)
    assert plan.precision.param_dtype == torch.float32  # auto on CPU
    assert plan.optimizer_states.per_parameter == 1
    assert plan.pipeline is None and plan.stages == (None,)
    assert plan.vocab_size == 64 and plan.memory is None
    assert (
        plan_job(
            job, DistributedContext.from_env(environ={}, device="cpu"), device="cuda"
        ).precision.param_dtype
        == torch.bfloat16
    )


def test_the_sequence_length_comes_from_the_built_dataset_or_the_config(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 50, encoding="utf-8")
    text = TextDataset(corpus, seq_len=10)
    built = BuildDatasetResult(dataset=text)  # a d9d.data dataset declares its length and vocabulary
    assert (built.seq_len, built.vocab_size) == (10, text.vocab_size)
    job = _job(tmp_path, mesh={"context_parallel": 2, "data_parallel_shard": 1})
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        plan = plan_job(job, ctx)  # RandomTokensProvider's config_type: seq_len 8
        assert (plan.sequence.seq_len, plan.sequence.source) == (
            8,
            "the seq_len default of providers.dataset (_job:RandomTokensProvider)",
        )
        assert plan.sequence.share is not None and plan.sequence.share.chunks == (0, 3)
        assert plan.sequence.cp_groups == ((0, 1),)
        with pytest.raises(SequenceLengthError, match="the dataset's sequences have 10 tokens"):
            plan_job(job, ctx, dataset=built)
        assert plan_job(job, ctx, seq_len=16).sequence.source == "--seq-len"
        with pytest.raises(SequenceLengthError, match="--seq-len gives 10 tokens"):
            plan_job(job, ctx, seq_len=10)


def test_a_dataset_with_its_own_seq_len_declares_it_and_each_rank_plans_its_share(tmp_path):
    class Sequences:  # any dataset with an int `seq_len` (and maybe `vocab_size`) declares them
        seq_len = 16

        def __len__(self) -> int:
            return 4

    built = BuildDatasetResult(dataset=Sequences())
    assert (built.seq_len, built.vocab_size) == (16, None)
    assert BuildDatasetResult(dataset=Sequences(), seq_len=8).seq_len == 8  # given: kept
    job = _job(tmp_path, mesh={"context_parallel": 2, "data_parallel_shard": 1})
    with DistributedContext.for_planning(job.config.mesh, rank=1) as ctx:
        share = plan_job(job, ctx, dataset=built).sequence.share
    assert share is not None and (share.rank, share.chunks, share.local_tokens) == (1, (1, 2), 8)


def test_an_attribute_named_like_an_ability_is_refused_not_called(tmp_path):
    job_file = tmp_path / "own.py"
    job_file.write_text(
        "from d9d.trainer import BuiltinOptimizerProvider\n\n"
        "class Optimizer(BuiltinOptimizerProvider):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.optimizer_states = {}  # its own bookkeeping, not the DeclaresOptimizerStates method\n",
        encoding="utf-8",
    )
    config = job_config(str(tmp_path / "runs"))
    config["providers"]["optimizer"] = f"{job_file}:Optimizer"
    with pytest.raises(
        ConfigError, match=r"attribute optimizer_states that is not a method.*DeclaresOptimizerStates"
    ):
        resolve_job(load_job_config(config))


def test_a_batch_that_does_not_split_is_refused_by_the_declaration(tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size"):
        _job(tmp_path, mesh={"data_parallel_shard": 3})  # resolve_job asks the declaration early
    job = _job(tmp_path)
    factory = job.data_factory
    with pytest.raises(BatchSizeError):
        factory.batching(job.config.mesh.__class__(data_parallel_shard=3))  # type: ignore[attr-defined]


def test_a_model_provider_without_stages_cannot_pipeline(tmp_path):
    job = _job(tmp_path, mesh={"pipeline_parallel": 2})
    refused = pytest.raises(TrainingError, match=r"needs a model provider with pipeline_num_layers\(\)")
    with DistributedContext.for_planning(job.config.mesh) as ctx, refused:
        plan_job(job, ctx)


def test_the_trainer_builds_from_its_plan(tmp_path):
    with Trainer.from_config(job_config(str(tmp_path / "runs"))) as trainer:
        plan = trainer.plan
        assert plan.batching is not None and plan.batching.microbatches_per_step == 4
        assert plan.precision == trainer.train_step.settings.precision  # type: ignore[attr-defined]
        assert plan.sequence.seq_len is None  # RandomTokens declares no length


def test_a_model_provider_refuses_a_sequence_length_before_anything_runs(tmp_path):
    job_file = tmp_path / "windowed.py"
    job_file.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from _job import TinyModelProvider\n\n"
        "class Windowed(TinyModelProvider):\n"
        "    def check_sequence_length(self, context):\n"
        "        if context.seq_len > 4:\n"
        "            raise ValueError(f'model.sliding_window=4 is shorter than the {context.seq_len}-token sequences')\n",
        encoding="utf-8",
    )
    config = job_config(str(tmp_path / "runs"))
    config["providers"]["model"] = f"{job_file}:Windowed"
    job = resolve_job(load_job_config(config))
    local = DistributedContext.from_env(environ={}, device="cpu")
    with pytest.raises(TrainingError, match=r"sliding_window=4 is shorter .* \(the sequence length: 8 from"):
        plan_job(job, local)  # RandomTokensProvider's config_type gives seq_len 8
    short = resolve_job(load_job_config({**config, "dataset": {"seq_len": 4}}))
    assert plan_job(short, local).sequence.seq_len == 4
    with pytest.raises(TrainingError, match=r"\(the sequence length: 6 from --seq-len\)"):
        plan_job(short, local, seq_len=6)
    assert not (tmp_path / "runs").exists()


def test_a_model_provider_adds_its_own_fields_to_the_job_built_line(tmp_path, capsys):
    job_file = tmp_path / "described.py"
    job_file.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from _job import TinyModelProvider\n\n"
        "class Described(TinyModelProvider):\n"
        "    def describe_model(self):\n"
        "        return {'backend': 'tiny-reference'}\n",
        encoding="utf-8",
    )
    config = job_config(str(tmp_path / "runs"))
    config["providers"]["model"] = f"{job_file}:Described"
    with Trainer.from_config(config):
        pass
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "job built" in line]
    assert "backend=tiny-reference" in line


def test_packed_documents_with_context_parallelism_are_planned_like_unpacked_rows(tmp_path):
    job = _job(tmp_path, mesh={"context_parallel": 2, "data_parallel_shard": 1})
    packed = BuildDatasetResult(dataset=[], seq_len=8, document_masking=True)
    with DistributedContext.for_planning(job.config.mesh) as ctx:
        plan = plan_job(job, ctx, dataset=packed)
        unpacked = plan_job(job, ctx, dataset=BuildDatasetResult(dataset=[], seq_len=8))
        assert plan.sequence.packed and not unpacked.sequence.packed  # the plan text's balance line
        assert (
            dataclasses.replace(plan, sequence=dataclasses.replace(plan.sequence, packed=False)) == unpacked
        )
        assert plan.sequence.seq_len == 8 and plan.sequence.share.local_tokens == 4
