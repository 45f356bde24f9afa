"""Heads through the trainer on both backends (`d9d.trainer:HFModelProvider`, `model.backend:
reference | hf`): a folder saved by `AutoModelForSequenceClassification` gives transformers' scores on
padded batches, a causal LM's folder a seeded fresh score head, exports load back in transformers
with the same scores, and what the backend cannot give a head is refused in one line."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import transformers
from _heads import PAD, randomize_
from _heads import padded_batch as _padded
from _tiny_hf import ARCHITECTURES, MORE_ARCHITECTURES, VOCAB, hf_job

from d9d.trainer import Trainer

BACKENDS = ("reference", "hf")


def classifier_folder(model_type: str, folder: Path, num_labels: int = 3) -> Path:
    """A tiny random transformers classifier saved as a folder."""
    config = {**ARCHITECTURES, **MORE_ARCHITECTURES}[model_type]()
    config.num_labels = num_labels
    randomize_(transformers.AutoModelForSequenceClassification.from_config(config)).save_pretrained(folder)
    return folder


def causal_folder(model_type: str, folder: Path) -> Path:
    torch.manual_seed(0)
    config = {**ARCHITECTURES, **MORE_ARCHITECTURES}[model_type]()
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def padded_batch() -> torch.Tensor:
    return _padded(VOCAB, seq=12)


def job(folder: Path, tmp_path: Path, backend: str, head: dict, name: str = "heads") -> dict:
    config = hf_job(folder, tmp_path / "runs", name=name)
    config["providers"]["model"] = "d9d.trainer:HFModelProvider"
    config["model"] = {"hf_folder": str(folder), "backend": backend, "head": head}
    return config


def scores(trainer: Trainer, ids: torch.Tensor) -> torch.Tensor:
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(ids).detach().clone()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_classifier_folder_gives_transformers_scores(backend, model_type, tmp_path):
    folder = classifier_folder(model_type, tmp_path / "cls")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ids = padded_batch()
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
    with Trainer.from_config(
        job(folder, tmp_path, backend, {"kind": "classification", "num_labels": 3})
    ) as trainer:
        trainer.resume()
        got = scores(trainer, ids)
    assert got.shape == (4, 3) and expected.std() > 0.5
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_are_scored_each_as_alone(backend, tmp_path):
    folder = classifier_folder("llama", tmp_path / "cls")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    ids[0, 10:] = PAD
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 2, 2, -1, -1]])  # the padding document: no score
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1]])
    with torch.no_grad():
        alone = torch.cat([theirs(input_ids=ids[:, a:b]).logits for a, b in ((0, 5), (5, 8), (8, 10))])
    head = {"kind": "classification", "num_labels": 3}
    with Trainer.from_config(job(folder, tmp_path, backend, head)) as trainer:
        trainer.resume()
        trainer.model.eval()
        with torch.no_grad():
            packed = trainer.model(ids, position_ids=positions, document_ids=documents)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_folder_gives_a_seeded_head_and_the_export_loads_in_transformers(backend, tmp_path):
    folder = causal_folder("qwen3", tmp_path / "lm")
    head = {"kind": "classification", "num_labels": 2}
    heads, ids = [], padded_batch()
    for run in ("a", "b"):
        with Trainer.from_config(job(folder, tmp_path, backend, head, name=run)) as trainer:
            trainer.resume()
            heads.append(trainer.model.state_dict()["score.weight"].detach().clone())
            got = scores(trainer, ids)
            trainer.export(tmp_path / f"out-{run}")
    torch.testing.assert_close(heads[0], heads[1], atol=0, rtol=0)  # seeded like the rest of the init
    assert 0.01 < heads[0].std() < 0.04  # normal(0, initializer_range): no LM-head rows read into it
    written = json.loads((tmp_path / "out-a" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3ForSequenceClassification"]
    assert (written["num_labels"], len(written["id2label"]), written["pad_token_id"]) == (2, 2, PAD)
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "out-a", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(got, back.eval()(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_embeddings_are_the_normalized_last_token_states_and_export_as_the_base_model(backend, tmp_path):
    folder = causal_folder("llama", tmp_path / "lm")
    base = transformers.AutoModel.from_pretrained(folder).eval()
    ids = padded_batch()
    with torch.no_grad():
        states = base(input_ids=ids).last_hidden_state
    last = (torch.arange(ids.shape[1]) * (ids != PAD)).argmax(-1)
    expected = F.normalize(states[torch.arange(4), last], dim=-1)
    with Trainer.from_config(
        job(folder, tmp_path, backend, {"kind": "embedding", "pooling": "last"})
    ) as trainer:
        trainer.resume()
        got = scores(trainer, ids)
        trainer.export(tmp_path / "out")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LlamaModel"]
    back, info = transformers.AutoModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        exported = back.eval()(input_ids=ids).last_hidden_state[torch.arange(4), last]
    torch.testing.assert_close(got, F.normalize(exported, dim=-1), atol=1e-5, rtol=1e-5)


def test_a_head_the_backend_cannot_build_is_one_line(tmp_path):
    folder = tmp_path / "cohere"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "cohere", "vocab_size": VOCAB}))
    config = job(folder, tmp_path, "hf", {"kind": "classification", "num_labels": 2})
    with pytest.raises(Exception) as caught:
        Trainer.from_config(config)
    message = str(caught.value)
    assert "has no sequence classifier in transformers" in message and "remove model.head" in message
    assert "\n" not in message
    assert not (tmp_path / "runs").exists()  # nothing written
