"""The reference model's heads against transformers: a folder saved by `AutoModelForSequenceClassification`
gives the same scores in d9d (padded batches, left and right), a causal LM's folder gives a fresh
score head, exports load back in transformers with the same scores, and the one-line refusals.

Run with: uv run pytest packages/d9d-trainer/tests/models/test_heads.py -q
"""

import json
import os
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F

from d9d.trainer.models import (
    ClassificationHead,
    EmbeddingHead,
    HeadExportError,
    ReferenceForCausalLM,
    ReferenceModelConfig,
    ReferenceModelConfigError,
    build_reference_model,
    load_hf_pretrained,
    read_hf_config,
    save_hf_pretrained,
)

sys.path.insert(0, str(Path(__file__).parent.parent))
from _heads import PAD, randomize_
from _heads import padded_batch as _padded

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB = 61
_SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rope_theta=10_000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
    pad_token_id=PAD,
)  # fmt: skip
HF_CONFIGS = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}


def hf_classifier(model_type: str, num_labels: int = 3, seed: int = 0):
    """A tiny random transformers classifier."""
    config = HF_CONFIGS[model_type](**_SHAPE, num_labels=num_labels)
    return randomize_(transformers.AutoModelForSequenceClassification.from_config(config), seed)


def padded_batch() -> torch.Tensor:
    return _padded(VOCAB)


def head_config(folder, head) -> ReferenceModelConfig:
    return read_hf_config(folder, head=head)


@pytest.mark.parametrize("model_type", HF_CONFIGS)
def test_classifier_folder_gives_transformers_scores(model_type, tmp_path):
    theirs = hf_classifier(model_type)
    theirs.save_pretrained(tmp_path)
    ours = build_reference_model(
        head_config(tmp_path, ClassificationHead(num_labels=3, pad_token_id=PAD))
    ).eval()
    load_hf_pretrained(ours, tmp_path)
    ids = padded_batch()
    with torch.no_grad():
        expected, got = theirs(input_ids=ids).logits, ours(ids)
    assert got.shape == (4, 3) and expected.std() > 0.5
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # each row's score is its own last real token's: a wrong pick would move it far
    with torch.no_grad():
        last_real = ours(ids[1:2, :7])
    torch.testing.assert_close(got[1:2], last_real, atol=1e-5, rtol=1e-5)


def test_packed_documents_score_each_document_as_alone(tmp_path):
    theirs = hf_classifier("qwen3")
    theirs.save_pretrained(tmp_path)
    ours = build_reference_model(head_config(tmp_path, ClassificationHead(num_labels=3, pad_token_id=PAD)))
    load_hf_pretrained(ours, tmp_path)
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, -1, -1]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1]])
    ids[0, 10:] = PAD
    with torch.no_grad():
        packed = ours.eval()(ids, positions, documents)
        alone = [theirs(input_ids=ids[:, a:b]).logits for a, b in ((0, 5), (5, 8), (8, 10))]
    assert packed.shape == (3, 3)  # the padding document is no sequence
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_causal_folder_gives_seeded_fresh_head_and_export_round_trips(tmp_path):
    causal = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**_SHAPE)).eval()
    causal.save_pretrained(tmp_path / "lm")
    config = head_config(tmp_path / "lm", ClassificationHead(num_labels=2, pad_token_id=PAD))
    heads = []
    for _ in range(2):
        torch.manual_seed(11)
        model = build_reference_model(config)
        load_hf_pretrained(model, tmp_path / "lm")
        heads.append(model.score.weight.detach().clone())
    torch.testing.assert_close(heads[0], heads[1], atol=0, rtol=0)  # seeded like the rest of init
    assert 0.01 < heads[0].std() < 0.04  # normal(0, initializer_range=0.02), not the LM head's rows
    torch.testing.assert_close(
        model.model.embed_tokens.weight, causal.model.embed_tokens.weight, atol=0, rtol=0
    )

    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # a head large enough that the scores mean something
    save_hf_pretrained(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForSequenceClassification"]
    assert (written["num_labels"], written["pad_token_id"]) == (2, PAD)
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), back.eval()(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("mean", True), ("mean", False)])
def test_embeddings_pool_the_real_tokens(pooling, normalize, tmp_path):
    base = transformers.AutoModel.from_config(transformers.LlamaConfig(**_SHAPE)).eval()
    causal = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_SHAPE))
    causal.model = base
    causal.save_pretrained(tmp_path)
    head = EmbeddingHead(pooling=pooling, normalize=normalize, pad_token_id=PAD)
    ours = build_reference_model(head_config(tmp_path, head))
    load_hf_pretrained(ours, tmp_path)
    ids = padded_batch()
    real = ids != PAD
    with torch.no_grad():
        got = ours.eval()(ids)
        states = base(input_ids=ids).last_hidden_state  # no attention mask, as the classifier runs
    if pooling == "mean":
        expected = (states * real[..., None]).sum(1) / real.sum(1, keepdim=True)
    else:
        last = (torch.arange(ids.shape[1]) * real).argmax(-1)
        expected = states[torch.arange(4), last]
    assert got.shape == (4, 32)
    torch.testing.assert_close(
        got, F.normalize(expected, dim=-1) if normalize else expected, atol=1e-5, rtol=1e-5
    )


def test_bad_heads_are_one_line_errors():
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=4)
    for head, words in (
        ({"kind": "classification", "num_labels": 0}, "model.head.num_labels=0 must be at least 1"),
        ({"kind": "embedding", "pooling": "max"}, "model.head.pooling='max' is not a pooling; use one of last, mean"),
    ):  # fmt: skip
        with pytest.raises(msgspec.ValidationError) as caught:
            ReferenceModelConfig.from_dict({**shape, "head": head})
        assert words in str(caught.value) and "\n" not in str(caught.value).split(" - at ")[0]
    with pytest.raises(ReferenceModelConfigError):
        ClassificationHead(num_labels=-1)


def test_reward_model_exported_without_score_head_is_refused(tmp_path):
    config = ReferenceModelConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_attention_heads=4
    )
    reward = msgspec.structs.replace(config, head=ClassificationHead(num_labels=1))
    with pytest.raises(HeadExportError, match="has no score head"):
        save_hf_pretrained(ReferenceForCausalLM(config), tmp_path, config=reward)
    assert not any(tmp_path.iterdir())  # nothing half-written
