"""The built-in data provider: `d9d.data.AutoDataProvider`, a fixed global batch over any mesh."""

from typing import Any

import msgspec

from d9d.data import AutoDataConfig, AutoDataProvider, DataProvider, SFTDataset, microbatches_per_rank
from d9d.mesh import MeshConfig, get_logger
from d9d.trainer.providers.data import Batching, BuildDataProviderContext

__all__ = ["AutoDataProviderFactory"]

_log = get_logger("d9d.trainer")


class AutoDataProviderFactory:
    """Builds `d9d.data.AutoDataProvider` over the dataset provider's dataset (`data:` section)."""

    config_type = AutoDataConfig

    def __init__(self, config: AutoDataConfig) -> None:
        self._config = config

    def batching(self, mesh: MeshConfig) -> Batching:
        """`global_batch_size` over dp ranks × microbatches of `microbatch_size` (checked to divide).

        Raises:
            BatchSizeError: the global batch does not split into dp × microbatch_size.
        """
        c = self._config
        n = microbatches_per_rank(c.global_batch_size, c.microbatch_size, mesh.data_parallel)
        return Batching(
            global_batch_size=c.global_batch_size,
            microbatch_size=c.microbatch_size,
            microbatches_per_step=n,
            data_parallel=mesh.data_parallel,
        )

    def build_data_provider(self, context: BuildDataProviderContext) -> DataProvider[Any]:
        """A fixed-global-batch provider sharded over the mesh's data-parallel ranks."""
        if context.dataset is None:
            raise ValueError("providers.dataset is required with the built-in AutoDataProvider")
        _log_dataset(context.dataset.dataset, context.context.is_main_process)
        return AutoDataProvider(
            self._config,
            context.dataset.dataset,
            context.dataset.collate_fn,
            context=context.context,
            pipeline_stages=context.pipeline_stages,
        )


def _log_dataset(dataset: Any, main_process: bool) -> None:
    """One line on rank 0 for an `SFTDataset`, which reports what building it did (`SFTDataset.stats`):
    records kept, truncated and dropped, and how full its (packed) rows are."""
    if not main_process or not isinstance(dataset, SFTDataset):
        return
    _log.info(
        "sft data",
        rows=len(dataset),
        packing_efficiency=round(dataset.packing_efficiency, 4),  # real tokens / token slots
        **msgspec.structs.asdict(dataset.stats),
    )
