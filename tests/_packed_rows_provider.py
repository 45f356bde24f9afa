"""Packed rows for the parity tests of packed documents: documents of skewed lengths, cut into rows.

Named in a job as `providers.dataset=<this file>:PackedRowsProvider` (its `dataset:` section is the
quickstart's: `path`, `seq_len`). The corpus's bytes are cut into documents of 1 to 2·seq_len tokens
(seeded), laid end to end and cut into rows of `seq_len`, so documents cross row boundaries (and so
microbatch boundaries), start exactly at them and span whole rows. Each row carries `position_ids`
(positions within the document, continuing across a row boundary) and `document_ids`; a token's
label is the next token of its document (-100 at a document's end).
"""

from pathlib import Path

import msgspec
import torch

from d9d.data import IGNORE_INDEX
from d9d.trainer.providers.data import BuildDatasetContext, BuildDatasetResult


class PackedRowsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The `dataset:` section: the text to cut (bytes) and the row length."""

    path: str
    seq_len: int = 128
    rows: int = 256


class PackedRows(torch.utils.data.Dataset):
    """`rows` rows of `seq_len` tokens of packed documents."""

    def __init__(self, text: bytes, seq_len: int, rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.tensor(list(text[: seq_len * rows + 1]), dtype=torch.long)
        total = tokens.numel() - 1
        lengths: list[int] = []
        while sum(lengths) < total:  # skewed: mostly short documents, a few longer than a row
            long = bool(torch.rand((), generator=generator) < 0.2)
            high = 2 * seq_len if long else max(2, seq_len // 3)
            lengths.append(int(torch.randint(1, high + 1, (), generator=generator)))
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:total]
        starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
        position = torch.arange(total) - starts[doc]
        labels = tokens[1 : total + 1].clone()
        labels[:-1][doc[1:] != doc[:-1]] = IGNORE_INDEX  # a document's last token predicts nothing
        self.columns = {
            "input_ids": tokens[:total].view(rows, seq_len),
            "labels": labels.view(rows, seq_len),
            "position_ids": position.view(rows, seq_len),
            "document_ids": doc.view(rows, seq_len),
        }

    def __len__(self) -> int:
        return self.columns["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {key: column[i] for key, column in self.columns.items()}


class PackedRowsProvider:
    """A dataset provider of `PackedRows` cut from the bytes of `dataset.path`."""

    config_type = PackedRowsConfig

    def __init__(self, config: PackedRowsConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        path = Path(self.config.path)
        if not path.is_absolute():
            path = Path(context.base_dir) / path
        dataset = PackedRows(path.read_bytes(), self.config.seq_len, self.config.rows)
        return BuildDatasetResult(
            dataset=dataset, seq_len=self.config.seq_len, vocab_size=256, document_masking=True
        )
