"""The validation loop's pieces: which microbatches a rank evaluates, the config rules, a local run."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import ConfigError, Trainer, read_metrics
from d9d.trainer.run.evaluation import eval_microbatches

EVAL_DATASET = {"samples": 20, "seq_len": 8, "seed": 7}


def _eval_job(save_dir: str, eval_section: dict | None = None, **extra) -> dict:
    config = job_config(
        save_dir, eval=eval_section or {"period_steps": 2}, eval_dataset=EVAL_DATASET, **extra
    )
    config["providers"]["eval_dataset"] = config["providers"]["dataset"]
    return config


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("samples", "size", "steps"), [(20, 3, None), (20, 4, None), (20, 3, 5), (9, 2, 100)]
)
def test_the_ranks_share_every_microbatch_once_and_run_as_many_forwards(dp, samples, size, steps):
    shares = [eval_microbatches(samples, size, steps, dp, rank) for rank in range(dp)]
    expected = [range(i * size, min((i + 1) * size, samples)) for i in range(math.ceil(samples / size))]
    expected = expected[:steps] if steps is not None else expected
    got = sorted((r for mine, _ in shares for r in mine), key=lambda r: r.start)
    assert got == expected  # in order, the last one partial, the first `steps` only
    most = math.ceil(len(expected) / dp)
    assert {n for _, n in shares} == {most}  # every rank runs as many forwards
    assert all(len(mine) in (most, most - 1) for mine, _ in shares)  # at most one of them discarded


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"unset_provider": True}, r"eval: needs providers\.eval_dataset"),
        ({"eval": {"period_steps": -1}}, r"eval\.period_steps must be >= 0"),
        ({"eval": {"steps": 0}}, r"eval\.steps must be >= 1"),
        ({"eval": {"microbatch_size": 0}}, r"eval\.microbatch_size must be >= 1"),
        ({"unset_eval": True}, r"providers\.eval_dataset is set but there is no eval: section"),
        (
            {"eval": {"microbatch_size": 21}},
            r"eval_dataset: the eval set has 20 samples.*lower eval\.microbatch_size",
        ),
    ],
)
def test_bad_eval_setups_are_refused_in_one_line_before_anything_is_written(tmp_path, change, message):
    config = _eval_job(
        str(tmp_path / "runs"), change.get("eval"), **({"mesh": change["mesh"]} if "mesh" in change else {})
    )
    if change.get("unset_provider"):
        del config["providers"]["eval_dataset"]
    if change.get("unset_eval"):
        del config["eval"]
    with pytest.raises(ConfigError, match=message) as caught:
        Trainer.from_config(config)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "runs").exists()


def test_a_local_run_records_its_evals_and_they_are_the_mean_token_loss(tmp_path):
    config = _eval_job(str(tmp_path), {"period_steps": 3, "microbatch_size": 3})
    with Trainer.from_config(config) as trainer:
        trainer.train()
        model = trainer.model
        from _job import RandomTokens, RandomTokensConfig

        data = RandomTokens(RandomTokensConfig(**EVAL_DATASET))
        with torch.no_grad():
            logits = model(data.tokens[:, :-1])
        expected = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), data.tokens[:, 1:].reshape(-1)
        ).item()
        again = trainer.evaluate()
    evals = {r["step"]: r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "eval_loss" in r}
    assert sorted(evals) == [3, 4]  # every 3 steps and after the last one
    assert evals[4]["eval_tokens"] == 20 * 8
    assert evals[4]["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert evals[4]["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert again.loss == evals[4]["eval_loss"]
    assert model.training  # the eval put it back in training mode
