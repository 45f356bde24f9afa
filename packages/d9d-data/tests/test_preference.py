import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from d9d.data import IGNORE_INDEX, DatasetError, PreferenceDataset, collate_preference, load_tokenizer

REPO = Path(__file__).resolve().parents[3]
HAS_CHAT = all(importlib.util.find_spec(m) is not None for m in ("tokenizers", "jinja2"))
HAS_TRL = all(importlib.util.find_spec(m) is not None for m in ("trl", "transformers", "datasets"))

# ChatML; the prompt alone ends with the generation prompt, which prompt + answer renders the same way.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PLAIN = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {
        "prompt": "In the beginning",
        "chosen": " God created the heaven.",
        "rejected": " was the word<|im_end|>",
    },
    {
        "prompt": "Call me Ishmael",
        "chosen": "?",
        "rejected": ". Some years ago, never mind how long precisely",
    },
    {"prompt": "And the earth", "chosen": " was without form", "rejected": "ly things"},
    # ends mid-word: the prompt's last token merges with the answer's first, so the completion starts
    # at the common prefix, before the end of the tokenized prompt
    {"prompt": "And the ear", "chosen": "th was without form", "rejected": "th moved"},
]


def _msg(role, content):
    return {"role": role, "content": content}


CHAT = [
    {
        "prompt": [_msg("system", "Be brief."), _msg("user", "What colour is the sky?")],
        "chosen": [_msg("assistant", "Blue.")],
        "rejected": [_msg("assistant", "A green thing, mostly, on Tuesdays.")],
    },
    {
        "prompt": [_msg("user", "hi"), _msg("assistant", "hello"), _msg("user", "again? «oui»")],
        "chosen": [_msg("assistant", "Again.")],
        "rejected": [_msg("assistant", "No. 日本")],
    },
    {
        "prompt": [_msg("user", "Who begat Enos?")],
        "chosen": [_msg("assistant", "Seth begat Enos.")],
        "rejected": [_msg("assistant", "Adam")],
    },
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A byte-level BPE folder whose post-processor adds a BOS (as Llama's): TRL's plain-text ids have it."""
    if not HAS_CHAT:
        pytest.skip("needs the optional tokenizers and jinja2 packages")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(REPO / "examples" / "data" / "corpus.txt")], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tok") / "bpe"
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _trl_batches(folder: Path, records: list, max_length: int) -> list[dict]:
    """TRL 1.16's own tokenization (`DPOTrainer._prepare_dataset`) and collation of each record alone."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    trainer = types.SimpleNamespace(_tokenizer=tokenizer)  # all `_prepare_dataset` reads of the trainer
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    tokenized = DPOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tokenizer, args, "train")
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=max_length)
    return [collator([example]) for example in tokenized]


@pytest.mark.skipif(not HAS_TRL, reason="trl, transformers and datasets are the oracle")
@pytest.mark.parametrize("records", [PLAIN, CHAT], ids=["plain", "conversational"])
def test_ids_and_completion_tokens_equal_trls(folder, tmp_path, records):
    """Same rows as TRL's collated batch (max_length=seq_len: one pair is cut), and the labels are
    exactly TRL's completion mask shifted by one."""
    source, pad = _jsonl(tmp_path / "p.jsonl", records), load_tokenizer(folder).pad_id
    whole = PreferenceDataset(source, 512, tokenizer=folder)
    seq_len = max(int((whole[i]["input_ids"] != pad).sum(1).max()) for i in range(len(records))) - 3
    dataset = PreferenceDataset(source, seq_len, tokenizer=folder)
    assert dataset.stats.truncated >= 1 and len(dataset) == len(records)
    for i, theirs in enumerate(_trl_batches(folder, records, seq_len)):
        ours, width = dataset[i], theirs["input_ids"].shape[1]
        assert torch.equal(ours["input_ids"][:, :width], theirs["input_ids"])
        assert (ours["input_ids"][:, width:] == pad).all()
        completion = theirs["completion_mask"][:, 1:].bool()
        assert torch.equal(ours["labels"][:, : width - 1] != IGNORE_INDEX, completion)
        assert torch.equal(ours["labels"][:, : width - 1][completion], theirs["input_ids"][:, 1:][completion])
        assert (ours["labels"][:, width - 1 :] == IGNORE_INDEX).all()
        assert dataset.completion_tokens[i].tolist() == completion.sum(1).tolist()


def _byte_records(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = ["sky", "blue", "whale", "sea", "earth", "form", "void", "light", "day", "night"]
    return [
        {
            "prompt": " ".join(rng.choice(words, size=rng.integers(1, 4))),
            "chosen": " " + " ".join(rng.choice(words, size=rng.integers(1, 4))),
            "rejected": " " + " ".join(rng.choice(words, size=rng.integers(1, 5))),
        }
        for _ in range(n)
    ]


def _sums(batch: dict, weights: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums, by scatter over sequence_ids, of a value of each (input token, label) pair."""
    labelled = batch["sequence_ids"] >= 0
    value = weights[batch["input_ids"]] * 3 + weights[batch["labels"].clamp(min=0)]
    sums = torch.zeros(2 * len(batch["pair_ids"]), dtype=torch.float64)
    return sums.scatter_add_(0, batch["sequence_ids"][labelled], value[labelled])


def test_packed_and_unpacked_batches_label_the_same_sequences(tmp_path):
    """Labels are the next token on completions only; sequence ids name the right pair and side; the
    scatter sums of packed and unpacked batches equal the sums over each pair's own rows."""
    source = _jsonl(tmp_path / "p.jsonl", _byte_records(13))
    plain = PreferenceDataset(source, 40)
    packed = PreferenceDataset(source, 128, pack=True)
    assert plain.num_pairs == packed.num_pairs == 13 and len(plain) == 13 and 1 < len(packed) < 13
    weights = torch.rand(plain.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    own = torch.zeros(13, 2, dtype=torch.float64)  # each pair's sums from its own two rows, no sequence ids
    for p in range(13):
        item = plain[p]
        for side in (0, 1):
            row = {key: item[key][side : side + 1] for key in ("input_ids", "labels")}
            keep = row["labels"] != IGNORE_INDEX
            own[p, side] = (weights[row["input_ids"]] * 3 + weights[row["labels"].clamp(min=0)])[keep].sum()
            assert keep.sum() == plain.completion_tokens[p, side]
    for dataset, items in ((plain, [3, 0, 7, 12]), (packed, range(len(packed)))):
        batch = collate_preference([dataset[i] for i in items])
        labelled = batch["labels"] != IGNORE_INDEX
        assert torch.equal(labelled, batch["sequence_ids"] >= 0)
        next_token = torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, :1]], 1)
        assert torch.equal(batch["labels"][labelled], next_token[labelled])
        assert not labelled[:, -1].any()
        pairs = batch["pair_ids"]
        torch.testing.assert_close(_sums(batch, weights).view(-1, 2), own[pairs], rtol=0, atol=1e-12)
        # the labelled tokens of 2k / 2k + 1 are the pair's own completions
        for k, pair in enumerate(pairs.tolist()):
            for side in (0, 1):
                alone = plain[pair]["labels"][side]
                assert torch.equal(batch["labels"][batch["sequence_ids"] == 2 * k + side], alone[alone >= 0])
    assert collate_preference([packed[i] for i in range(len(packed))])["pair_ids"].tolist() == list(range(13))


def test_packed_rows_keep_chosen_and_rejected_apart(tmp_path):
    """Each sequence is its own document (positions from 0, its own id), rows are filled greedily in
    file order, and padding is document -1 as in SFTDataset's packed rows."""
    source = _jsonl(tmp_path / "p.jsonl", _byte_records(13))
    plain, packed = PreferenceDataset(source, 40), PreferenceDataset(source, 128, pack=True)
    assert packed.document_masking and not plain.document_masking and packed.rows_per_item == 1
    lengths = [int((plain[p]["input_ids"] != plain.tokenizer.eos_id).sum()) + 2 for p in range(13)]
    for index in range(len(packed)):
        item = packed[index]
        docs, positions, ids = item["document_ids"][0], item["position_ids"][0], item["input_ids"][0]
        pairs = item["pair_ids"].tolist()
        assert sorted(set(docs.tolist()) - {-1}) == list(range(2 * len(pairs)))
        for k, pair in enumerate(pairs):
            for side in (0, 1):
                where = torch.nonzero(docs == 2 * k + side).flatten()
                assert torch.equal(where, torch.arange(where[0], where[-1] + 1))  # one contiguous run
                assert torch.equal(positions[where], torch.arange(len(where)))
                alone = plain[pair]["input_ids"][side]
                assert (
                    torch.equal(ids[where], alone[: len(where)])
                    and (alone[len(where) :] == plain.tokenizer.eos_id).all()
                )
        used = int((docs >= 0).sum())
        assert used == sum(lengths[p] for p in pairs) <= 128 and (docs[used:] == -1).all()
        if index + 1 < len(packed):  # greedy: the next row's first pair did not fit here
            assert used + lengths[pairs[-1] + 1] > 128
    assert 0.5 < packed.packing_efficiency <= 1


def test_truncation_and_drop_are_counted(tmp_path):
    """Byte tokens: prompt 'abc' + completion + EOS. A sequence over seq_len keeps its start; packed,
    the longer of a pair is cut first, down to the shorter, then both evenly."""
    records = [
        {"prompt": "abc", "chosen": "de", "rejected": "fgh"},  # 6 and 7 tokens
        {"prompt": "abc", "chosen": "de", "rejected": "fghijkl"},  # 6 and 11
        {"prompt": "abc", "chosen": "defghij", "rejected": "klmnopqr"},  # 11 and 12
    ]
    source = _jsonl(tmp_path / "p.jsonl", records)
    cut = PreferenceDataset(source, 8)
    assert (cut.stats.pairs, cut.stats.truncated, cut.stats.dropped_too_long) == (3, 2, 0)
    assert cut.completion_tokens.tolist() == [[3, 4], [3, 5], [5, 5]]
    assert cut[1]["input_ids"][1].tolist() == list(b"abcfghij")  # the start, no EOS
    dropped = PreferenceDataset(source, 8, overflow="drop")
    assert (dropped.stats.pairs, dropped.stats.truncated, dropped.stats.dropped_too_long) == (1, 0, 2)
    packed = PreferenceDataset(source, 15, pack=True)
    assert packed.stats.truncated == 2 and len(packed) == 3
    assert packed.completion_tokens.tolist() == [[3, 4], [3, 6], [5, 4]]  # 6+9, then 8+7 of 15
    assert packed.stats.label_tokens == 25 and packed.stats.tokens == 6 + 7 + 6 + 9 + 8 + 7
    assert "3 of 3 preference pairs kept (2 truncated" in str(packed.stats)
    exact = PreferenceDataset(
        _jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2), 12, pack=True
    )
    assert len(exact) == 1 and exact.packing_efficiency == 1  # two pairs of 3 + 3 fill a row of 12


BAD = {
    "missing": ({"prompt": "abc", "chosen": "de"}, "missing 'rejected'"),
    "empty": ({"prompt": "abc", "chosen": "", "rejected": "de"}, "'chosen' is empty"),
    "long prompt": ({"prompt": "a" * 8, "chosen": "de", "rejected": "fg"}, "prompt is 8 tokens"),
    "mixed": (
        {"prompt": [_msg("user", "abc")], "chosen": [_msg("assistant", "d")], "rejected": []},
        "one format",
    ),
    "not text": ({"prompt": "abc", "chosen": ["de"], "rejected": "fg"}, "'chosen' must be a string"),
}
CHAT_BAD = {
    "user answer": ([_msg("user", "d")], "'chosen' message 0 has role 'user'"),
    "a string": ("d", "'chosen' must be a non-empty list of assistant messages"),
    "no answer": ([], "'chosen' must be a non-empty list"),
    "empty answer": ([_msg("assistant", " ")], "'chosen' message 0 is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plain_records_are_one_line_naming_file_and_line(tmp_path, case):
    record, message = BAD[case]
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": "abc", "chosen": "de", "rejected": "fg"}, record])
    with pytest.raises(DatasetError, match=message) as error:
        PreferenceDataset(source, 8)
    assert str(error.value).startswith(f"{source}:2: ") and "\n" not in str(error.value)
    assert "seq_len=8" in str(error.value) or case != "long prompt"


@pytest.mark.parametrize("case", sorted(CHAT_BAD))
def test_bad_conversational_records_are_one_line_naming_file_and_line(folder, tmp_path, case):
    chosen, message = CHAT_BAD[case]
    record = {"prompt": [_msg("user", "abc")], "chosen": chosen, "rejected": [_msg("assistant", "fg")]}
    source = _jsonl(tmp_path / "p.jsonl", [CHAT[0], record])
    with pytest.raises(DatasetError, match=message) as error:
        PreferenceDataset(source, 64, tokenizer=folder)
    assert str(error.value).startswith(f"{source}:2: ") and "\n" not in str(error.value)
