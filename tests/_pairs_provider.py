"""Synthetic preference pairs for the parity tests of preference tasks, in `d9d.data.PreferenceDataset`'s
batch layout, without a tokenizer: prompts and completions are seeded runs of byte ids.

Named in a job as `providers.dataset=<this file>:PairsProvider` with a `dataset:` section of `pairs`,
`seq_len`, `seed` and `pack`. Unpacked, a pair is two rows (prompt + chosen, prompt + rejected), padded
with id 256; packed, whole pairs share rows as separate documents (positions restart per document).
"""

from typing import Any

import msgspec
import torch

from d9d.data import IGNORE_INDEX
from d9d.trainer.providers.data import BuildDatasetContext, BuildDatasetResult

PAD = 256


class PairsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pairs: int = 16
    seq_len: int = 32
    seed: int = 1
    pack: bool = False


def _pair(generator: torch.Generator) -> list[tuple[torch.Tensor, int]]:
    """(token ids, prompt length) of a pair's chosen and rejected sequences (the same prompt)."""
    prompt = torch.randint(0, 256, (int(torch.randint(3, 9, (), generator=generator)),), generator=generator)
    sides = []
    for _ in range(2):
        completion = torch.randint(
            0, 256, (int(torch.randint(2, 11, (), generator=generator)),), generator=generator
        )
        sides.append((torch.cat([prompt, completion]), prompt.numel()))
    return sides


class Pairs(torch.utils.data.Dataset):
    """`pairs` pairs: one item per pair (unpacked) or per row of whole pairs (packed)."""

    def __init__(self, config: PairsConfig) -> None:
        generator = torch.Generator().manual_seed(config.seed)
        self.num_pairs, self.seq_len, self.document_masking = config.pairs, config.seq_len, config.pack
        self.reference_logps: torch.Tensor | None = None
        pairs = [_pair(generator) for _ in range(config.pairs)]
        groups = _pack(pairs, config.seq_len) if config.pack else [[k] for k in range(config.pairs)]
        self.items = [self._item(group, pairs, config.pack) for group in groups]

    def _item(self, group: list[int], pairs: list[Any], pack: bool) -> dict[str, torch.Tensor]:
        rows = 1 if pack else 2
        seq = self.seq_len
        out = {
            "input_ids": torch.full((rows, seq), PAD),
            "labels": torch.full((rows, seq), IGNORE_INDEX),
            "sequence_ids": torch.full((rows, seq), -1),
            "position_ids": torch.zeros((rows, seq), dtype=torch.long),
            "document_ids": torch.full((rows, seq), -1),  # padding: document -1, as d9d.data pads
        }
        row, start, document = 0, 0, 0
        for k, pair_id in enumerate(group):
            for side, (ids, prompt) in enumerate(pairs[pair_id]):
                n = ids.numel()
                span = slice(start, start + n)
                out["input_ids"][row, span] = ids
                out["labels"][row, start + prompt - 1 : start + n - 1] = ids[prompt:]
                out["sequence_ids"][row, start + prompt - 1 : start + n - 1] = 2 * k + side
                out["position_ids"][row, span] = torch.arange(n)
                out["document_ids"][row, span] = document
                out["position_ids"][row, start + n :] = torch.arange(seq - start - n)
                document += 1
                if pack:
                    start += n
                else:
                    row, start = row + 1, 0
        out["pair_ids"] = torch.tensor(group)
        if not pack:
            del out["position_ids"], out["document_ids"]
        return out

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {key: torch.cat([item[key] for item in items]) for key in items[0] if key != "sequence_ids"}
        before, parts = 0, []
        for item in items:
            ids = item["sequence_ids"]
            parts.append(torch.where(ids >= 0, ids + 2 * before, ids))
            before += item["pair_ids"].numel()
        out["sequence_ids"] = torch.cat(parts)
        if self.reference_logps is not None:
            out["reference_logps"] = self.reference_logps[out["pair_ids"]]
        return out


def _pack(pairs: list[Any], seq_len: int) -> list[list[int]]:
    """Whole pairs into rows of `seq_len` tokens, in order."""
    rows: list[list[int]] = [[]]
    used = 0
    for k, sides in enumerate(pairs):
        size = sum(ids.numel() for ids, _ in sides)
        if used + size > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(k)
        used += size
    return rows


class PairsProvider:
    config_type = PairsConfig

    def __init__(self, config: PairsConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        dataset = Pairs(self.config)
        return BuildDatasetResult(dataset=dataset, collate_fn=dataset.collate, seq_len=self.config.seq_len,
                                  vocab_size=257, document_masking=self.config.pack)  # fmt: skip
