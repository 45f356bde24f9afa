"""`SequenceClassificationTask` through the trainer on the reference model with a classification head:
the eval's accuracy and macro F1 are the whole eval set's (recomputed here from the trained model's
predictions), FSDP 2, TP 2 and PP 2 give one process's losses and metrics, and a label outside
`num_labels` is one line."""

import json
import sys
from pathlib import Path

import msgspec
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _heads import PAD

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer, TrainingError
from d9d.trainer.builtins.classification import macro_f1
from d9d.trainer.providers import BuildDatasetResult

CLASSES, VOCAB, SEQ = 3, 48, 8


class LabelledRowsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 32
    seed: int = 0
    bad_label: bool = False


class LabelledRows(torch.utils.data.Dataset):
    """Right-padded rows of 3 to 8 tokens labelled by their last real token mod 3 (learnable from the
    token the head reads)."""

    def __init__(self, config: LabelledRowsConfig) -> None:
        g = torch.Generator().manual_seed(config.seed)
        self.ids = torch.randint(1, VOCAB, (config.samples, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (config.samples,), generator=g)
        for i, n in enumerate(lengths.tolist()):
            self.ids[i, n:] = PAD
        self.labels = self.ids[torch.arange(config.samples), lengths - 1] % CLASSES
        if config.bad_label:
            self.labels[5] = CLASSES

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class LabelledRowsProvider:
    config_type = LabelledRowsConfig

    def __init__(self, config: LabelledRowsConfig) -> None:
        self.config = config

    def build_dataset(self, context: object) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=LabelledRows(self.config), seq_len=SEQ)


MODEL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def job(save_dir: Path, mesh: dict | None = None, **dataset: object) -> dict:
    head = {"kind": "classification", "num_labels": CLASSES, "pad_token_id": PAD}
    return {
        "providers": {
            "model": "d9d.trainer:ReferenceModelProvider",
            "dataset": f"{__name__}:LabelledRowsProvider",
            "eval_dataset": f"{__name__}:LabelledRowsProvider",
            "task": "d9d.trainer:SequenceClassificationTask",
        },
        "model": {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head": head,
        },
        "task": {"num_labels": CLASSES},
        "dataset": dict(dataset),
        "eval_dataset": {"samples": 12, "seed": 1},
        "eval": {"period_steps": 0, "microbatch_size": 2},
        "mesh": mesh or {},
        "data": {"global_batch_size": 8, "microbatch_size": 2, "seed": 1},
        "trainer": {
            "run": {"name": "cls"},
            "schedule": {"total_steps": 3},
            "checkpointing": {"save_dir": str(save_dir), "period_steps": 0},
            "logging": {"period_steps": 1},
        },
        "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant", "warmup_steps": 0},
    }


def _train(config: dict, predict: bool = True) -> tuple[list[dict], torch.Tensor | None]:
    """The run's metrics records, and (`predict`) the trained model's predictions on the eval set."""
    with Trainer.from_config(config) as trainer:
        trainer.train()
        records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
        if not predict:
            return records, None
        evaluation = LabelledRows(LabelledRowsConfig(samples=12, seed=1))
        trainer.model.eval()
        with torch.no_grad():
            predicted = trainer.model(evaluation.ids).argmax(-1)
    return records, predicted


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _train(job(tmp_path_factory.mktemp("one")))


def test_eval_accuracy_and_macro_f1_are_the_whole_eval_sets(one_process):
    records, predicted = one_process
    labels = LabelledRows(LabelledRowsConfig(samples=12, seed=1)).labels
    tp = [int(((predicted == c) & (labels == c)).sum()) for c in range(CLASSES)]
    fp = [int(((predicted == c) & (labels != c)).sum()) for c in range(CLASSES)]
    fn = [int(((predicted != c) & (labels == c)).sum()) for c in range(CLASSES)]
    last = records[-1]
    assert last["eval_accuracy"] == pytest.approx(float((predicted == labels).float().mean()), abs=1e-12)
    assert last["eval_f1"] == pytest.approx(macro_f1(tp, fp, fn), abs=1e-12)
    assert 0 < last["eval_f1"] < 1 and last["eval_f1"] != pytest.approx(last["eval_accuracy"])
    assert all(0 <= r["accuracy"] <= 1 for r in records)


def test_macro_f1_by_hand():
    # class 0: tp 2 fp 1 fn 0 → 0.8; class 1: tp 0 fp 0 fn 1 → 0; class 2 absent everywhere: left out
    assert macro_f1([2, 0, 0], [1, 0, 0], [0, 1, 0]) == pytest.approx(0.4)


def _records(config: dict) -> list[dict]:
    return _train(config, predict=False)[0]


@pytest.mark.parametrize(
    "mesh",
    [{"data_parallel_shard": 2}, {"tensor_parallel": 2}, {"pipeline_parallel": 2}],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_a_mesh_gives_one_process_losses_and_metrics(one_process, tmp_path, mesh):
    expected = one_process[0]
    for records in run_distributed(_records, 2, job(tmp_path, mesh), timeout=120):
        for got, want in zip(records, expected, strict=True):
            for key in ("loss", "accuracy", "f1", "eval_accuracy", "eval_f1", "eval_loss"):
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_a_label_outside_num_labels_is_one_line(tmp_path):
    with (
        Trainer.from_config(job(tmp_path, bad_label=True)) as trainer,
        pytest.raises(TrainingError) as caught,
    ):
        trainer.train()
    message = str(caught.value)
    assert f"label {CLASSES}, outside 0..{CLASSES - 1} (task.num_labels={CLASSES})" in message
    assert "\n" not in message
