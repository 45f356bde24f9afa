"""`PreparedDataProvider`: the built-in dataset provider of folders `d9d data prepare` wrote.

    providers: {dataset: d9d.trainer:PreparedDataProvider}
    dataset: {path: prepared/, seq_len: 2048}
    # or a weighted mixture of several prepared folders:
    dataset:
      seq_len: 2048
      mixture:
        - {path: prepared/web, weight: 0.7}
        - {path: prepared/code, weight: 0.3}

Paths are relative to the config file. A config needs no Python file for pretraining data. The
tokenizer the folders were prepared with (the copy each keeps) is the run's: `d9d generate` encodes
prompts with it and exports carry its files.
"""

from typing import Literal

import msgspec

from d9d.data import DataConfigError, MixtureDataset, PreparedDataset, Tokenizer, TokenizerError
from d9d.mesh import DistributedContext, get_logger
from d9d.trainer.providers.data import BuildDatasetContext, BuildDatasetResult

__all__ = ["MixtureSource", "PreparedDataConfig", "PreparedDataProvider"]

_log = get_logger("d9d.trainer")


class MixtureSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One entry of `dataset.mixture`: a prepared folder and its weight (any scale; normalized)."""

    path: str
    weight: float = 1.0
    name: str | None = None


class PreparedDataConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The `dataset:` section of `PreparedDataProvider`.

    Attributes:
        seq_len: tokens per sample.
        path: one prepared folder; or
        mixture: several, each with a weight (`d9d.data.MixtureDataset`).
        document_masking: samples carry `position_ids` and `document_ids`, so the packed documents
            do not attend to each other (the model must support it).
        exhausted: with a mixture, "repeat" (a source that runs out starts a new pass in a new order)
            or "stop" (the run ends, saved, after the last step before any source would repeat).
        seed: seed of each mixture source's pass orders (the batches' order is `data.seed`'s).
    """

    seq_len: int
    path: str | None = None
    mixture: list[MixtureSource] | None = None
    document_masking: bool = False
    exhausted: Literal["repeat", "stop"] = "repeat"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise DataConfigError(f"dataset.seq_len must be an integer >= 1, got {self.seq_len!r}")
        if (self.path is None) == (self.mixture is None):
            raise DataConfigError(
                "dataset needs exactly one of path (a prepared folder) and mixture (a list of {path, weight})"
            )
        if self.mixture is not None and not self.mixture:
            raise DataConfigError("dataset.mixture is empty; list at least one {path, weight}")
        for i, source in enumerate(self.mixture or []):
            if isinstance(source.weight, bool) or not source.weight > 0:
                raise DataConfigError(
                    f"dataset.mixture[{i}].weight must be a number > 0, got {source.weight!r}"
                )


class PreparedDataProvider:
    """Samples of `seq_len` tokens from one prepared folder or a weighted mixture of several."""

    config_type = PreparedDataConfig

    def __init__(self, config: PreparedDataConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        """The `PreparedDataset` (or `MixtureDataset` of them); rank 0 logs what it holds."""
        config, base = self.config, context.base_dir
        if config.path is not None:
            dataset = PreparedDataset(
                base / config.path, config.seq_len, document_masking=config.document_masking
            )
            if context.context.is_main_process:
                index = dataset.index
                _log.info("prepared data", path=str(dataset.path), documents=index.documents,
                          tokens=index.tokens, samples=len(dataset), tokenizer=index.tokenizer)  # fmt: skip
            return BuildDatasetResult(dataset=dataset, tokenizer=_tokenizer(dataset, context.context))
        assert config.mixture is not None
        parts = [
            PreparedDataset(base / s.path, config.seq_len, document_masking=config.document_masking)
            for s in config.mixture
        ]
        names = [s.name or s.path for s in config.mixture]
        made = {p.index.tokenizer_identity for p in parts}
        if len(made) > 1:
            shown = ", ".join(f"{n}: {p.index.tokenizer}" for n, p in zip(names, parts, strict=True))
            raise DataConfigError(
                f"dataset.mixture's folders were prepared with different tokenizers ({shown}); prepare every "
                "source with the model's tokenizer"
            )
        mixture = MixtureDataset(
            parts,
            [s.weight for s in config.mixture],
            names=names,
            seed=config.seed,
            exhausted=config.exhausted,
        )
        if context.context.is_main_process:
            shares = {name: round(share, 4) for name, share in zip(names, mixture.shares, strict=True)}
            _log.info(
                "prepared data mixture", samples=len(mixture), shares=shares, exhausted=config.exhausted,
                **({"ends_after_samples": mixture.stream_end} if mixture.stream_end is not None else {}),
            )  # fmt: skip
        return BuildDatasetResult(dataset=mixture, tokenizer=_tokenizer(parts[0], context.context))


def _tokenizer(dataset: PreparedDataset, context: DistributedContext) -> Tokenizer | None:
    """The folder's tokenizer; None (rank 0 says why: the job trains without it) when it cannot load."""
    try:
        return dataset.load_tokenizer()
    except TokenizerError as exc:
        if context.is_main_process:
            _log.warning("prepared data: no tokenizer for d9d generate and exports", reason=str(exc))
        return None
