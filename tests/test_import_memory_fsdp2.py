"""The peak memory of starting a run from a Hugging Face folder under FSDP 2, per rank, for both
fine-tune backends (transformers' model through `d9d.trainer.hf`, and the reference model through
d9d's mappers): building the trainer and importing the folder never holds more tensor storage than
the rank's half of the model plus one decoder layer (and a few KB of slack).

The model is a Llama whose vocabulary (embedding and LM head, 4096 × 32 each) is many decoder layers
large, as in real LLMs, so holding one of them whole (an unsharded copy to initialize, the full
tensor read) breaks the bound. Storage is counted exactly, op by op (`StoragePeak`), not sampled.
The import's values are checked too: each rank's model gives transformers' logits.
"""

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from _storage_peak import StoragePeak

from d9d.mesh.testing import run_distributed
from d9d.trainer.providers import BuildDatasetResult

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"
VOCAB = 4096
SEQ = 8
#: The rank's data loader, the rotary tables and FSDP's padding: a few KB on this model.
SLACK_BYTES = 16 * 1024


class TokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 16


class TokensProvider:
    """Random token rows (a few hundred bytes: the storage counted is the model's)."""

    config_type = TokensConfig

    def __init__(self, config: TokensConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        tokens = torch.randint(
            3, VOCAB, (self.config.samples, SEQ + 1), generator=torch.Generator().manual_seed(0)
        )
        rows = [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]
        return BuildDatasetResult(dataset=rows, seq_len=SEQ)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch.distributed.fsdp  # imported once here, not in every forked rank

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("import-memory") / "llama"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _job(folder: Path, save_dir: Path, backend: str) -> dict[str, Any]:
    return {
        "providers": {"model": f"{FINETUNE}:HFModelProvider", "dataset": f"{__name__}:TokensProvider"},
        "mesh": {"data_parallel_shard": 2},
        "model": {"hf_folder": str(folder), "backend": backend},
        "data": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {
            "run": {"name": backend},
            "schedule": {"total_steps": 1},
            "checkpointing": {"save_dir": str(save_dir), "period_steps": 0},
        },
    }


def _build_and_import(config: dict[str, Any]) -> dict[str, Any]:
    """One rank: the peak storage of building the trainer and importing the folder, the model's full
    size and one decoder layer's (bytes), and its logits on a probe batch."""
    from d9d.trainer import Trainer

    with StoragePeak() as peak:
        trainer = Trainer.from_config(config)
        trainer.resume()  # a fresh run: the folder's weights
    with trainer:
        model = trainer.model
        layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
        model.eval()
        with torch.no_grad():
            logits = model(ids).detach().clone()
        return {
            "peak": peak.peak,
            "model": sum(p.numel() * p.element_size() for p in model.parameters()),
            "layer": sum(p.numel() * p.element_size() for p in layer.parameters()),
            "logits": logits,
            "ids": ids,
        }


@pytest.mark.parametrize("backend", ["hf", "reference"])
def test_the_import_under_fsdp2_holds_half_the_model_plus_one_layer_per_rank(tmp_path, folder, backend):
    import transformers

    ranks = run_distributed(_build_and_import, 2, _job(folder, tmp_path / "runs", backend), timeout=120)
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for rank in ranks:
        bound = rank["model"] / 2 + rank["layer"] + SLACK_BYTES
        assert rank["layer"] * 8 < rank["model"] / 2  # the vocabulary holds many layers' worth
        assert rank["peak"] <= bound, (rank["peak"], rank["model"], rank["layer"])
        with torch.no_grad():
            want = expected(input_ids=rank["ids"], use_cache=False).logits
        torch.testing.assert_close(rank["logits"], want, rtol=0, atol=1e-5)
