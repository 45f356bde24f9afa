"""The rules of a job config that no section can check alone: settings that each are valid but do not
work together (yet), names the lower packages' vocabularies must know, the dataset provider the built-in
data provider needs, and no file in the way of a directory the job writes.

All of them run once, when the config is loaded (`d9d.trainer.job.load`), before torch is imported.
"""

import logging
import os
from pathlib import Path

from d9d.mesh import MeshConfig
from d9d.parallel.pipeline import PIPELINE_SCHEDULES, PipelineConfig, PipelineError
from d9d.trainer.config.job import JobConfig
from d9d.trainer.errors import ConfigError
from d9d.trainer.job.paths import JobPaths

__all__ = ["check_job_settings", "check_rules", "shards_parameters"]


def check_rules(config: JobConfig, where: str) -> None:
    """Rules the section structs cannot check alone, as they need the lower packages' vocabularies.

    Raises:
        ConfigError: a log level logging does not know, or a pipeline schedule (or stages per rank) that does not exist.
    """
    level = config.trainer.logging.level
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(
            f"{where}: trainer.logging.level {level!r} is not a log level; "
            "use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
        )
    pipelining = config.pipelining
    if pipelining.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"{where}: pipelining.schedule {pipelining.schedule!r} is not a pipeline schedule; "
            f"choose one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    try:
        PipelineConfig(pipelining.schedule, pipelining.stages_per_rank)
    except PipelineError as exc:
        raise ConfigError(f"{where}: pipelining.stages_per_rank: {exc}") from None


#: The built-in data provider, which needs a dataset provider.
_BUILTIN_DATA = "d9d.trainer:AutoDataProviderFactory"


def check_job_settings(config: JobConfig, paths: JobPaths, where: str) -> None:
    """The checks that need no provider: the directories the job writes (no file in their way),
    settings that each are valid but do not work together (yet), and the dataset provider the
    built-in data provider needs.

    Raises:
        ConfigError: naming the keys and the fix.
    """
    _check_directories(paths, where)
    _check_combinations(config, where)
    _check_offload(config, where)
    _check_eval(config, where)
    if config.providers.dataset is None and config.providers.data == _BUILTIN_DATA:
        raise ConfigError(
            f"{where}: providers.dataset is missing; the built-in AutoDataProvider needs a dataset provider "
            "(e.g. providers.dataset: train.py:MyDataset), or set providers.data to your own data provider"
        )


def shards_parameters(mesh: MeshConfig) -> bool:
    """Whether FSDP2 shards the parameters on this mesh (dp_shard and cp ranks shard as one axis)."""
    return mesh.data_parallel_shard > 1 or mesh.context_parallel > 1


def _check_offload(config: JobConfig, where: str) -> None:
    """`trainer.memory.cpu_offload` needs FSDP2 units that shard; expert banks do not offload (yet)."""
    if not config.trainer.memory.cpu_offload:
        return
    mesh = config.mesh
    if not shards_parameters(mesh):
        raise ConfigError(
            f"{where}: trainer.memory.cpu_offload needs sharded parameters, but the mesh "
            f"({mesh.describe_degrees()}) has no FSDP shard (FSDP2 offloads only sharded units; one process "
            "or replicas alone keep full copies); set mesh.data_parallel_shard to 2 or more, or "
            "trainer.memory.cpu_offload: false"
        )
    if mesh.expert_parallel > 1:
        raise ConfigError(
            f"{where}: trainer.memory.cpu_offload with mesh.expert_parallel={mesh.expert_parallel} is not "
            "supported yet (the expert banks are FSDP2 units of their own, which stay on the device); set "
            "mesh.expert_parallel: 1 or trainer.memory.cpu_offload: false"
        )


def _check_combinations(config: JobConfig, where: str) -> None:
    """Settings that each are valid but do not work together (yet), or that would do nothing."""
    profiling, total = config.trainer.profiling, config.trainer.schedule.total_steps
    if profiling.active_steps and profiling.start_step > total:
        raise ConfigError(
            f"{where}: trainer.profiling.start_step={profiling.start_step} is after the last step "
            f"(trainer.schedule.total_steps={total}), so nothing would be profiled; set start_step to at "
            f"most {total} or trainer.profiling.active_steps: 0"
        )
    if config.trainer.compile.enabled and config.mesh.tensor_parallel > 1:
        raise ConfigError(
            f"{where}: trainer.compile.enabled with mesh.tensor_parallel={config.mesh.tensor_parallel} is not "
            "supported yet (torch 2.15: a compiled block whose input is an un-waited AsyncCollectiveTensor, "
            "as a vocab-parallel embedding's output is, hands DTensor a plain gradient in backward); set "
            "trainer.compile.enabled: false or mesh.tensor_parallel: 1"
        )
    if config.trainer.precision.float8 is not None and config.mesh.tensor_parallel > 1:
        raise ConfigError(
            f"{where}: trainer.precision.float8 with mesh.tensor_parallel={config.mesh.tensor_parallel} is not "
            "supported yet (float8 linears need their own tensor-parallel styles); remove trainer.precision.float8 "
            "or set mesh.tensor_parallel: 1"
        )
    if config.trainer.precision.float8 is not None and config.peft.lora is not None:
        raise ConfigError(
            f"{where}: trainer.precision.float8 with peft.lora is not supported yet (the adapters would wrap "
            "float8 linears); remove one of the two sections"
        )


def _check_eval(config: JobConfig, where: str) -> None:
    """The `eval:` section and `providers.eval_dataset` come together."""
    providers = config.providers
    if config.eval is not None and providers.eval_dataset is None:
        raise ConfigError(
            f"{where}: eval: needs providers.eval_dataset, the validation set's dataset provider "
            "(e.g. providers.eval_dataset: train.py:MyDataset, configured by an eval_dataset: section); "
            "add it or remove the eval: section"
        )
    if config.eval is None and providers.eval_dataset is not None:
        raise ConfigError(
            f"{where}: providers.eval_dataset is set but there is no eval: section, so it would never be "
            "used; add eval: {period_steps: N} (0: only after the last step) or remove providers.eval_dataset"
        )
    keep_best = config.trainer.checkpointing.keep_best
    if keep_best is not None and config.eval is None:
        raise ConfigError(
            f"{where}: trainer.checkpointing.keep_best ranks checkpoints by {keep_best.metric}, which only an "
            "eval: section records; add eval: {period_steps: N} with providers.eval_dataset, or remove keep_best"
        )
    if config.eval is not None and config.eval.early_stopping is not None and config.eval.period_steps == 0:
        raise ConfigError(
            f"{where}: eval.early_stopping needs evals during the run, but eval.period_steps is 0 (only after "
            "the last step); set eval.period_steps: N, or remove eval.early_stopping"
        )


def _check_directories(paths: JobPaths, where: str) -> None:
    """Each directory the job writes must be a directory or creatable: no file may stand in its way."""
    for key, target in paths.written.items():
        blocker = _file_in_the_way(target)
        if blocker is not None:
            raise ConfigError(
                f"{where}: {key}: {blocker} is a file, not a directory; "
                f"point {key} elsewhere or move the file away"
            )


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` (or `path` itself) when it is not a directory."""
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return None if candidate.is_dir() else candidate
    return None
