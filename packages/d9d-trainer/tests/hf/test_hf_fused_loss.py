"""The Hugging Face backend's fused head loss against transformers' own loss and gradients (float32),
per architecture whose logits are `lm_head(hidden states)` (gemma2 and gemma3_text soft-capped, tied);
an architecture not verified keeps the full logits."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import ARCHITECTURES, MORE_ARCHITECTURES, VOCAB, load_hf, save_tiny

from d9d.parallel import LinearCrossEntropyHead, LossConfig
from d9d.trainer.hf.model import FUSED_LOSS_ARCHITECTURES, HFCausalLM, fuse_head_loss

#: Measured (torch 2.15, transformers 5.24, CPU, float32): the fused loss is within 1.2e-7 of
#: transformers' relative, the gradients within 4e-7 of the largest gradient entry of each parameter.
LOSS_REL = 1e-6
GRAD_REL = 1e-6
VERIFIED = sorted(FUSED_LOSS_ARCHITECTURES & {*ARCHITECTURES, *MORE_ARCHITECTURES})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that adds nothing
    return ids, labels


@pytest.mark.parametrize("model_type", VERIFIED)
def test_fused_loss_equals_transformers_loss_and_gradients(tmp_path, model_type):
    folder = save_tiny(model_type, tmp_path / model_type)
    ids, labels = _batch()
    theirs = load_hf(folder).train()
    expected = theirs(input_ids=ids, labels=labels, use_cache=False).loss  # mean over labelled tokens
    expected.backward()
    ours = HFCausalLM(load_hf(folder).train())
    assert fuse_head_loss(ours, LossConfig(chunk_size=5)) is None  # 5 does not divide the 32 tokens
    assert isinstance(ours.get_output_embeddings(), LinearCrossEntropyHead)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)  # the task's labels
    loss = ours(ids, labels=shifted) / (shifted != -100).sum()
    loss.backward()
    assert abs(loss.item() - expected.item()) <= LOSS_REL * abs(expected.item())
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        scale = param.grad.abs().max().clamp_min(1e-30)
        off = float((grads[name].grad - param.grad).abs().max() / scale)
        assert off <= GRAD_REL, f"{model_type} {name}: gradient off by {off:.2e}"


def test_an_unverified_architecture_keeps_the_full_logits(tmp_path):
    folder = save_tiny("deepseek_v3", tmp_path / "deepseek_v3")
    model = HFCausalLM(load_hf(folder))
    problem = fuse_head_loss(model, LossConfig())
    assert problem is not None and "deepseek_v3" in problem
    assert model.fused_loss_chunk_size is None
    assert not isinstance(model.get_output_embeddings(), LinearCrossEntropyHead)
