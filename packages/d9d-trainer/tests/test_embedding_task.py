"""`EmbeddingTask`: the in-batch InfoNCE with negatives gathered over data-parallel ranks equals one
process's over all the ranks' pairs (loss and the gradients of every query and positive, on 2 forked
gloo ranks, uneven counts included); through the trainer on the reference model's embedding head the
eval's retrieval accuracy is the whole eval set's."""

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _heads import PAD

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer
from d9d.trainer.builtins.embedding import contrastive_loss
from d9d.trainer.providers import BuildDatasetResult

TEMPERATURE = 0.1
COUNTS = (3, 2)  # pairs on rank 0 and rank 1 (uneven, as an eval's last microbatch may be)


def _embeddings() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    total = sum(COUNTS)
    queries = F.normalize(torch.randn(total, 8, generator=g), dim=-1)
    positives = F.normalize(queries + 0.8 * torch.randn(total, 8, generator=g), dim=-1)
    return queries, positives


def _rank_part() -> tuple[float, float, torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    start = sum(COUNTS[:rank])
    queries, positives = (t[start : start + COUNTS[rank]].clone().requires_grad_() for t in _embeddings())
    loss, correct = contrastive_loss(queries, positives, TEMPERATURE, dist.group.WORLD)
    loss.backward()
    return loss.item(), correct.item(), queries.grad, positives.grad


def test_gathered_negatives_give_one_process_loss_and_gradients():
    queries, positives = (t.clone().requires_grad_() for t in _embeddings())
    loss, correct = contrastive_loss(queries, positives, TEMPERATURE)
    loss.backward()
    with torch.no_grad():  # InfoNCE written out: pair k's positive is the k-th candidate
        similarities = queries @ positives.T / TEMPERATURE
        by_hand = -(similarities.diag() - similarities.logsumexp(-1)).sum()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    parts = run_distributed(_rank_part, 2, timeout=60)
    assert sum(p[0] for p in parts) == pytest.approx(loss.item(), rel=1e-6)
    assert sum(p[1] for p in parts) == correct.item() and 0 < correct.item() < sum(COUNTS)
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), queries.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p[3] for p in parts]), positives.grad, atol=1e-6, rtol=1e-5)


VOCAB, SEQ = 48, 8


class PairsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 32
    seed: int = 0


class Pairs(torch.utils.data.Dataset):
    """(query, positive) pairs of right-padded rows: the positive is the query with its tokens shifted by one."""

    def __init__(self, config: PairsConfig) -> None:
        g = torch.Generator().manual_seed(config.seed)
        queries = torch.randint(2, VOCAB - 1, (config.samples, SEQ), generator=g)
        queries[:, 6:] = PAD
        positives = torch.where(queries == PAD, PAD, queries + 1)
        self.ids = torch.stack([queries, positives], dim=1)  # [samples, 2, SEQ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class PairsProvider:
    config_type = PairsConfig

    def __init__(self, config: PairsConfig) -> None:
        self.config = config

    def build_dataset(self, context: object) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=Pairs(self.config), seq_len=SEQ)


def test_eval_retrieval_accuracy_is_the_whole_eval_sets(tmp_path):
    head = {"kind": "embedding", "pooling": "mean", "pad_token_id": PAD}
    config = {
        "providers": {
            "model": "d9d.trainer:ReferenceModelProvider",
            "dataset": f"{__name__}:PairsProvider",
            "eval_dataset": f"{__name__}:PairsProvider",
            "task": "d9d.trainer:EmbeddingTask",
        },
        "model": dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_layers=2,
            num_attention_heads=4,
            head=head,
        ),
        "task": {"temperature": TEMPERATURE},
        "eval_dataset": {"samples": 12, "seed": 1},
        "eval": {"period_steps": 0, "microbatch_size": 4},
        "data": {"global_batch_size": 8, "microbatch_size": 4, "seed": 1},
        "trainer": {
            "run": {"name": "emb"},
            "schedule": {"total_steps": 3},
            "checkpointing": {"save_dir": str(tmp_path), "period_steps": 0},
        },
        "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant", "warmup_steps": 0},
    }
    with Trainer.from_config(config) as trainer:
        trainer.train()
        last = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        trainer.model.eval()
        hits = 0
        with torch.no_grad():  # each eval microbatch of 4 pairs: its own positives are the candidates
            for pairs in Pairs(PairsConfig(samples=12, seed=1)).ids.split(4):
                out = trainer.model(pairs.flatten(0, 1))
                hits += int(((out[0::2] @ out[1::2].T).argmax(-1) == torch.arange(len(pairs))).sum())
    assert last["eval_accuracy"] == pytest.approx(hits / 12, abs=1e-12)
    assert "accuracy" in last and last["eval_loss"] > 0
