"""Resolve a loaded job config into provider instances, each built from its own config section.

Also the checks that need the providers, still before any process group, file or model exists: a
declared batching against the mesh, a bfloat16 optimizer state the optimizer declares. Those that
need none ran when the config was loaded (`d9d.trainer.job.rules`).
"""

import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import msgspec
import torch

from d9d.data import DataError
from d9d.mesh import D9dError, one_line
from d9d.trainer.callbacks import Callback
from d9d.trainer.config.base import ConfigImport, ConfigPath
from d9d.trainer.config.job import JobConfig
from d9d.trainer.config.trainer import CallbackConfig
from d9d.trainer.errors import ConfigError
from d9d.trainer.job.convert import check_values, convert_section
from d9d.trainer.job.load import LoadedJob
from d9d.trainer.providers.data import DataProviderFactory, DatasetProvider, DeclaresBatching
from d9d.trainer.providers.declared import undeclared_methods
from d9d.trainer.providers.model import (
    ChecksMesh,
    ChecksSequenceLength,
    DescribesModel,
    ImportsModelWeights,
    ModelProvider,
    PipelineModelProvider,
)
from d9d.trainer.providers.optim import DeclaresOptimizerStates, LRSchedulerProvider, OptimizerProvider
from d9d.trainer.providers.task import PipelineTask, PreparesSteps, Task

__all__ = ["ResolvedJob", "resolve_config_paths", "resolve_job", "resolve_object"]

#: The optional abilities (protocols of `d9d.trainer.providers`) a provider of each role may declare.
_ABILITIES: dict[str, tuple[type, ...]] = {
    "model": (ChecksMesh, ChecksSequenceLength, PipelineModelProvider, ImportsModelWeights, DescribesModel),
    "task": (PipelineTask, PreparesSteps),
    "data": (DeclaresBatching,),
    "optimizer": (DeclaresOptimizerStates,),
}


@dataclass(frozen=True)
class ResolvedJob:
    """A validated job config and the providers it names, constructed and ready."""

    loaded: LoadedJob
    model_provider: ModelProvider
    dataset_provider: DatasetProvider | None
    data_factory: DataProviderFactory
    task: Task
    optimizer_provider: OptimizerProvider
    lr_scheduler_provider: LRSchedulerProvider
    eval_dataset_provider: DatasetProvider | None = None
    """The validation set's provider (`providers.eval_dataset`), None without an `eval:` section."""
    sections: Mapping[str, Any] = field(default_factory=dict)
    """Each provider's config section as it was constructed with (role → its `config_type` instance,
    or the raw mapping without one), e.g. `sections["dataset"]`."""
    callbacks: tuple[Callback, ...] = ()
    """`trainer.callbacks`, constructed (each from its `config:` section), in the config's order."""

    @property
    def config(self) -> JobConfig:
        """The job config."""
        return self.loaded.config


def resolve_job(loaded: LoadedJob) -> ResolvedJob:
    """Import every provider and construct it from its section (`model:`, `dataset:`, `data:`, ...).

    Raises:
        ConfigError: a provider does not import, lacks a required method, or its section does not fit;
            the batch sizes do not divide over the mesh; a directory to write is blocked by a file.
    """
    config = loaded.config
    where = loaded.where
    providers = config.providers
    sections: dict[str, Any] = {
        "model": (
            providers.model,
            config.model,
            "model",
            ("initialize_model_stage", "parallelize_model_stage", "prepare_export_model_stage"),
        ),
        "task": _task_section(providers.task, loaded),
        "data": (providers.data, config.data, "data", ("build_data_provider",)),
        "optimizer": (providers.optimizer, config.optimizer, "optimizer", ("build_optimizer",)),
        "lr_scheduler": (
            providers.lr_scheduler,
            config.lr_scheduler,
            "lr_scheduler",
            ("build_lr_scheduler",),
        ),
    }
    if providers.dataset is not None:
        sections["dataset"] = (providers.dataset, config.dataset, "dataset", ("build_dataset",))
    if providers.eval_dataset is not None:
        sections["eval_dataset"] = (
            providers.eval_dataset,
            config.eval_dataset,
            "eval_dataset",
            ("build_dataset",),
        )
    built: dict[str, Any] = {}
    arguments: dict[str, Any] = {}
    for role, (spec, section, section_key, methods) in sections.items():
        cls = resolve_object(spec, loaded.base_dir, key=f"{where}: providers.{role}")
        built[role], arguments[role] = _construct(
            cls, section, loaded, where=where, role=role, section_key=section_key, methods=methods, spec=spec
        )
    if "dataset" in built:
        built["dataset"] = _GuardedDatasetProvider(built["dataset"], spec=providers.dataset or "")
    if "eval_dataset" in built:
        built["eval_dataset"] = _GuardedDatasetProvider(
            built["eval_dataset"], spec=providers.eval_dataset or "", role="eval_dataset"
        )
    _check_task_mesh(config, built["task"], providers.task, where)
    _check_batch(config, built["data"])
    _check_state_dtype(config, built["optimizer"], where=where)
    callbacks = tuple(
        _callback(entry, f"trainer.callbacks[{i}]", loaded, where)
        for i, entry in enumerate(config.trainer.callbacks)
    )
    return ResolvedJob(
        loaded=loaded,
        model_provider=built["model"],
        dataset_provider=built.get("dataset"),
        data_factory=built["data"],
        task=built["task"],
        optimizer_provider=built["optimizer"],
        lr_scheduler_provider=built["lr_scheduler"],
        eval_dataset_provider=built.get("eval_dataset"),
        sections=arguments,
        callbacks=callbacks,
    )


#: The sections a task may read (its class's `config_section`; none by default).
TASK_SECTIONS = ("task", "preference", "rl")


def _task_section(spec: str, loaded: LoadedJob) -> tuple[str, Any, str | None, tuple[str, ...]]:
    """`providers.task` with the section its class reads (`config_section`: `task` or `preference`).

    Raises:
        ConfigError: a task section is given that the task does not read, or the class names another.
    """
    config, where = loaded.config, loaded.where
    cls = resolve_object(spec, loaded.base_dir, key=f"{where}: providers.task")
    wanted = getattr(cls, "config_section", None)
    if wanted is not None and wanted not in TASK_SECTIONS:
        raise ConfigError(
            f"{where}: providers.task ({spec}) reads section {wanted!r}; a task's config_section must be "
            f"one of {', '.join(TASK_SECTIONS)}"
        )
    for key in TASK_SECTIONS:
        if key != wanted and getattr(config, key):
            raise ConfigError(
                f"{where}: a {key}: section is given but providers.task ({spec}) does not read it; remove "
                f"the section or name a task that does (d9d.trainer:PreferenceTask reads preference:, "
                "d9d.trainer:GRPOTask rl:)"
            )
    methods = ("batch_weight", "compute_loss")
    return spec, (getattr(config, wanted) if wanted else {}), wanted, methods


def _check_task_mesh(config: JobConfig, task: Any, spec: str, where: str) -> None:
    """A task that declares `supports_context_parallel = False` on a mesh with context parallelism, or
    `supports_eval = False` with an `eval:` section."""
    if getattr(task, "supports_eval", True) is False and config.eval is not None:
        raise ConfigError(
            f"{where}: providers.task ({spec}) has no eval loss of a held-out set (its steps are made from "
            "rollouts); remove the eval: section (its metrics per step are in metrics.jsonl)"
        )
    cp = config.mesh.context_parallel
    if getattr(task, "supports_context_parallel", True) is False and isinstance(cp, int) and cp > 1:
        raise ConfigError(
            f"{where}: providers.task ({spec}) does not run under context parallelism (its per-sequence "
            f"scores need whole sequences on one rank); set mesh.context_parallel: 1 (got {cp})"
        )


def _callback(entry: str | CallbackConfig, key: str, loaded: LoadedJob, where: str) -> Callback:
    """One `trainer.callbacks` entry, imported and constructed like a provider."""
    spec, section = (entry, {}) if isinstance(entry, str) else (entry.target, dict(entry.config))
    cls = resolve_object(spec, loaded.base_dir, key=f"{where}: {key}")
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ConfigError(
            f"{where}: {key} names {spec!r}, which is not a d9d.trainer.Callback subclass; "
            "subclass d9d.trainer.Callback and override its on_* events"
        )
    instance, _ = _construct(cls, section, loaded, where=where, role=key, section_key=f"{key}.config",
                             methods=(), spec=spec)  # fmt: skip
    return instance


def _construct(
    cls: Any,
    section: Any,
    loaded: LoadedJob,
    *,
    where: str,
    role: str,
    section_key: str | None,
    methods: tuple[str, ...],
    spec: str,
) -> tuple[Any, Any]:
    """The provider instance and the argument it was constructed with (its converted section)."""
    label = f"providers.{role}" if not role.startswith("trainer.") else role
    if not callable(cls):
        raise ConfigError(f"{where}: {label} names {cls!r}, which is not a class")
    config_type = getattr(cls, "config_type", None)
    prefix = section_key or role
    if config_type is not None:
        raw = msgspec.to_builtins(section) if isinstance(section, msgspec.Struct) else section
        try:
            argument = convert_section(raw, config_type, where=where, prefix=prefix)
        except ConfigError:
            raise
        except Exception as exc:  # not a type msgspec can convert into, or its own check crashed
            raise ConfigError(
                f"{where}: {label} ({spec}): its config_type {config_type!r} cannot hold the "
                f"{prefix}: section ({type(exc).__name__}: {one_line(exc)}); make config_type a "
                "msgspec.Struct (or a dataclass) whose fields are the section's keys"
            ) from None
        check_values(argument, where=where, prefix=prefix)
        argument = resolve_config_paths(argument, loaded)  # `ConfigPath` fields: from the config's directory
    else:
        argument = section
    try:
        instance = cls(argument)
    except Exception as exc:  # the provider's own code: any exception is one line naming it
        raise ConfigError(
            f"{where}: constructing {label} ({spec}) failed: {type(exc).__name__}: "
            f"{one_line(exc)}; fix the provider or its {prefix}: section"
        ) from exc
    missing = [m for m in methods if not callable(getattr(instance, m, None))]
    if missing:
        raise ConfigError(f"{where}: {label} ({cls.__name__}) lacks {', '.join(missing)}; implement it")
    for ability in _ABILITIES.get(role, ()):
        for name in undeclared_methods(instance, ability):
            raise ConfigError(
                f"{where}: {label} ({cls.__name__}) has an attribute {name} that is not a method, "
                f"but d9d reads {name}() as the {ability.__name__} ability (d9d.trainer.{ability.__name__}); "
                f"rename the attribute or make it that method"
            )
    return instance, argument


class _GuardedDatasetProvider:
    """The dataset provider, with any exception of its `build_dataset` turned into one line naming it.

    d9d's own errors (a missing dataset file, ...) pass unchanged: they already say what to do.
    """

    def __init__(self, provider: Any, *, spec: str, role: str = "dataset") -> None:
        self._provider = provider
        self._spec = spec
        self._role = role

    def build_dataset(self, context: Any) -> Any:
        try:
            return self._provider.build_dataset(context)
        except (D9dError, OSError, MemoryError):
            raise
        except Exception as exc:
            raise ConfigError(
                f"providers.{self._role} ({self._spec}).build_dataset failed: {type(exc).__name__}: "
                f"{one_line(exc)}; fix the dataset provider or its {self._role}: section"
            ) from exc


def _check_state_dtype(config: JobConfig, provider: OptimizerProvider, *, where: str) -> None:
    """`optimizer.state_dtype: bfloat16` only for an optimizer provider that declares bfloat16 states:
    another one would silently keep float32 states (and the plan would count them wrong)."""
    if config.optimizer.state_dtype == "float32":
        return
    declared = provider.optimizer_states() if isinstance(provider, DeclaresOptimizerStates) else None
    if declared is not None and declared.dtype == torch.bfloat16:
        return
    said = (
        "declares no optimizer_states()"
        if declared is None
        else f"declares {declared.dtype or 'float32'} states"
    )
    raise ConfigError(
        f"{where}: optimizer.state_dtype: bfloat16, but providers.optimizer ({config.providers.optimizer}) "
        f"{said}; set optimizer.state_dtype: float32, or have its optimizer_states() return "
        "OptimizerStates(..., dtype=torch.bfloat16) and keep its states in bfloat16"
    )


def _check_batch(config: JobConfig, factory: DataProviderFactory) -> None:
    """A declared batching (`DeclaresBatching`) against the mesh: pure, so checked up front."""
    if not isinstance(factory, DeclaresBatching):
        return
    try:
        factory.batching(config.mesh)
    except DataError as exc:  # the message names data.* and the mesh degrees already
        raise ConfigError(str(exc)) from None


def resolve_config_paths(value: Any, loaded: LoadedJob) -> Any:
    """`value` (a converted section: a msgspec struct) with each `ConfigPath` field made absolute,
    nested structs included; anything else is returned as it is."""
    if not isinstance(value, msgspec.Struct):
        return value
    changes: dict[str, Any] = {}
    for member in msgspec.structs.fields(type(value)):
        current = getattr(value, member.name)
        if isinstance(current, str) and _is_config_path(member.type):
            changes[member.name] = str(loaded.resolve_path(current))
        elif isinstance(current, str) and _is_config_import(member.type):
            target, sep, name = current.rpartition(":")
            if sep and target.endswith(".py"):  # a file beside the config: absolute, as a path is
                changes[member.name] = f"{loaded.resolve_path(target)}:{name}"
        elif isinstance(current, msgspec.Struct):
            resolved = resolve_config_paths(current, loaded)
            if resolved is not current:
                changes[member.name] = resolved
    return msgspec.structs.replace(value, **changes) if changes else value


def _is_config_path(annotation: Any) -> bool:
    return annotation is ConfigPath or ConfigPath in get_args(annotation)


def _is_config_import(annotation: Any) -> bool:
    return annotation is ConfigImport or ConfigImport in get_args(annotation)


def resolve_object(spec: str, base_dir: Path, *, key: str) -> Any:
    """Import `module.path:Name` or `file.py:Name` (relative to `base_dir`) and return the object.

    Raises:
        ConfigError: naming `key` (the config key that holds `spec`) when it cannot be resolved.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"{key}: {spec!r} must look like package.module:Name or file.py:Name")
    if target.endswith(".py"):
        file = (base_dir / target).resolve()
        if not file.is_file():
            raise ConfigError(f"{key}: {spec!r}: no file {file}; paths are relative to the config file")
        module_name = "_d9d_user_" + re.sub(r"\W", "_", str(file.with_suffix("")))
        module = sys.modules.get(module_name)
        if module is None:
            spec_obj = importlib.util.spec_from_file_location(module_name, file)
            assert spec_obj is not None and spec_obj.loader is not None
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[module_name] = module
            # like a script run directly: its own directory is importable (for sibling modules)
            if str(file.parent) not in sys.path:
                sys.path.insert(0, str(file.parent))
            try:
                spec_obj.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[module_name]
                raise ConfigError(f"{key}: importing {file} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            missing = exc.name or ""
            if missing and missing != target and not target.startswith(missing + "."):
                # the module was found; something it imports was not
                raise ConfigError(
                    f"{key}: importing module {target!r} failed: {type(exc).__name__}: {exc}; "
                    "is the package it needs installed?"
                ) from None
            raise ConfigError(
                f"{key}: cannot import module {target!r} ({exc}); is the package installed?"
            ) from None
        except Exception as exc:  # the module exists but its own code failed
            raise ConfigError(
                f"{key}: importing module {target!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{key}: {target!r} has no attribute {name!r}") from None
