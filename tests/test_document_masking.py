"""Packed documents never attend across each other: a packed row's loss and gradients equal those of
its documents run one by one, through the reference model and the built-in task, with the positions
and document ids d9d.data yields."""

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from d9d.data import TextDataset
from d9d.trainer import CausalLMTask
from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig
from d9d.trainer.providers import LossContext

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data"


def _model() -> ReferenceForCausalLM:
    torch.manual_seed(0)
    config = ReferenceModelConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return ReferenceForCausalLM(config)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_packed_row_equals_its_documents_run_one_by_one_loss_and_gradients():
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 257, (n + 1,), generator=generator) for n in (5, 7, 4)]
    packed_model, alone_model = _model(), None
    alone_model = copy.deepcopy(packed_model)

    batch = {
        "input_ids": torch.cat([d[:-1] for d in documents])[None],
        "labels": torch.cat([d[1:] for d in documents])[None],
        "position_ids": torch.cat([torch.arange(len(d) - 1) for d in documents])[None],
        "document_ids": torch.cat([torch.full((len(d) - 1,), i) for i, d in enumerate(documents)])[None],
    }
    task = CausalLMTask()
    packed = task.compute_loss(LossContext(model=packed_model, batch=batch, device=torch.device("cpu")))
    packed.loss_sum.backward()

    total = torch.zeros(())
    for d in documents:  # each document alone: plain causal attention from position 0
        total = total + F.cross_entropy(alone_model(d[:-1][None])[0], d[1:], reduction="sum")
    total.backward()

    assert int(packed.weight) == sum(len(d) - 1 for d in documents)
    assert abs(packed.loss_sum.detach().item() - total.detach().item()) <= 1e-6 * abs(total.detach().item())
    expected = _grads(alone_model)
    assert expected.keys() == _grads(packed_model).keys()
    for name, grad in _grads(packed_model).items():  # fp32: relative to each gradient's norm
        assert float((grad - expected[name]).norm()) <= 1e-6 * float(expected[name].norm()), name


def test_with_document_masking_a_document_is_blind_to_the_others_in_its_row():
    dataset = TextDataset(CORPUS, seq_len=256, document_masking=True)  # two files: two documents
    sample = next(
        s for s in (dataset[i] for i in range(len(dataset))) if len(set(s["document_ids"].tolist())) > 1
    )
    ids, docs = sample["input_ids"][None], sample["document_ids"][None]
    model = _model().eval()
    first = docs[0, 0]
    changed = ids.clone()
    changed[docs == first] = (changed[docs == first] + 1) % 256  # rewrite the row's first document
    with torch.no_grad():
        before = model(ids, sample["position_ids"][None], docs)
        after = model(changed, sample["position_ids"][None], docs)
    others = docs[0] != first
    assert torch.equal(before[0, others], after[0, others])  # the later documents did not see it
    assert not torch.equal(before[0, ~others], after[0, ~others])
