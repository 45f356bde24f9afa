"""`d9d.trainer:PreferenceDatasetProvider`: a `dataset:` section of preference pairs, as a job resolves it."""

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.data import IGNORE_INDEX, DatasetError, collate_preference
from d9d.trainer import PreferenceDatasetConfig, load_job_config, resolve_job
from d9d.trainer.providers import BuildDatasetContext

PAIRS = [
    {"prompt": "the sky is", "chosen": " blue", "rejected": " green"},
    {"prompt": "the sea is", "chosen": " deep and blue", "rejected": " dry"},
    {"prompt": "the whale is", "chosen": " big", "rejected": " green and small"},
]


def _job(tmp_path, **dataset):
    """A job config in tmp_path whose dataset is the built-in provider over pairs.jsonl (paths relative)."""
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted({w for p in PAIRS for text in p.values() for w in text.split()})
    vocab = {w: i for i, w in enumerate(["<pad>", "[UNK]", *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    config = {"eos_token": "</s>", "pad_token": "<pad>"}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS), encoding="utf-8")
    config = job_config(str(tmp_path / "runs"))
    config["providers"]["dataset"] = "d9d.trainer:PreferenceDatasetProvider"
    config["dataset"] = {"path": "pairs.jsonl", "tokenizer": "tok", **dataset}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return resolve_job(load_job_config(tmp_path / "config.yaml"))


@pytest.mark.parametrize("pack", [False, True])
def test_the_provider_builds_pairs_with_their_collate_fn(tmp_path, pack):
    job = _job(tmp_path, seq_len=16, pack=pack)
    assert isinstance(job.sections["dataset"], PreferenceDatasetConfig)
    built = job.dataset_provider.build_dataset(BuildDatasetContext(context=None, base_dir=tmp_path))
    assert built.collate_fn is collate_preference and built.document_masking is pack
    assert built.seq_len == 16 and built.tokenizer is built.dataset.tokenizer and built.dataset.num_pairs == 3
    batch = built.collate_fn([built.dataset[i] for i in range(len(built.dataset))])
    assert batch["pair_ids"].tolist() == [0, 1, 2] and ("document_ids" in batch) is pack
    eos = built.tokenizer.eos_id  # each sequence: the prompt's 3 words, its answer, then EOS
    answers = [len(p[side].split()) + 1 for p in PAIRS for side in ("chosen", "rejected")]
    for sequence, count in enumerate(answers):
        labels = batch["labels"][batch["sequence_ids"] == sequence]
        assert len(labels) == count and labels[-1] == eos and (labels != IGNORE_INDEX).all()


def test_a_bad_pair_is_one_line_before_anything_trains(tmp_path):
    job = _job(tmp_path, seq_len=3)
    with pytest.raises(DatasetError, match=r"pairs\.jsonl:1: the prompt is 3 tokens.*seq_len=3") as error:
        job.dataset_provider.build_dataset(BuildDatasetContext(context=None, base_dir=tmp_path))
    assert "\n" not in str(error.value)
