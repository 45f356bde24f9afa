"""`Trainer.stream_weights` on the Hugging Face backend: on FSDP 2 (real gloo ranks) rank 0 gets the
export's tensors (Hugging Face's own names, a tied table once), which load bucket by bucket into the
folder's transformers model and give the exported model's logits."""

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, hf_logits, load_hf, probe_batch, save_tiny

from d9d.mesh.testing import run_distributed

BUCKET = 16 * 2**10


def _train_and_stream(config: dict[str, Any], export: Path) -> list[list[tuple[str, torch.Tensor]]]:
    from d9d.trainer import Trainer

    with Trainer.from_config(config) as trainer:
        trainer.train()
        trainer.export(export)
        return [list(bucket) for bucket in trainer.stream_weights(torch.float32, BUCKET)]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"], ids=["llama", "gemma2_tied"])
def test_fsdp2_streams_the_export_into_transformers(tmp_path, model_type):
    folder = save_tiny(model_type, tmp_path / "folder")
    export = tmp_path / "export"
    config = hf_job(folder, tmp_path / "runs", steps=1, mesh={"data_parallel_shard": 2})
    first, second = run_distributed(_train_and_stream, 2, config, export, timeout=120)
    assert len(first) == len(second) > 2 and all(bucket == [] for bucket in second)
    streamed = dict(pair for bucket in first for pair in bucket)
    written = load_file(export / "model.safetensors")
    assert sorted(streamed) == sorted(written)
    for name, tensor in written.items():
        assert torch.equal(streamed[name], tensor), name
    model = load_hf(folder)  # the untrained weights, overwritten bucket by bucket
    for bucket in first:
        assert not model.load_state_dict(dict(bucket), strict=False).unexpected_keys
    ids, positions = probe_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(logits, hf_logits(export), rtol=0, atol=1e-5)
    assert not torch.allclose(logits, hf_logits(folder))  # it trained: the stream is not the folder
