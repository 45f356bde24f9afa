"""A dataset provider of random token sequences (no files), for throughput benchmarks."""

from typing import Any

import msgspec
import torch

from d9d.trainer.providers import BuildDatasetResult


class SyntheticConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: int = 64
    seq_len: int = 128
    vocab_size: int = 257
    seed: int = 0


class SyntheticTokens(torch.utils.data.Dataset):
    """`samples` sequences of seq_len + 1 random tokens; each sample is input_ids and shifted labels."""

    def __init__(self, config: SyntheticConfig) -> None:
        g = torch.Generator().manual_seed(config.seed)
        self.tokens = torch.randint(0, config.vocab_size, (config.samples, config.seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


class SyntheticTokensProvider:
    config_type = SyntheticConfig

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config

    def build_dataset(self, context: Any) -> BuildDatasetResult:
        return BuildDatasetResult(dataset=SyntheticTokens(self.config))
