"""Read a job's YAML file (plus `--set key.path=value` overrides) and resolve its providers.

Everything that can be wrong with a config fails here, before any process group, file or model
exists: YAML syntax, unknown keys, wrong types, rule violations, providers that do not import, and
the providers' own config sections. Each error is one `ConfigError` line naming the file, the key
path and the fix.
"""

import copy
import dataclasses
import importlib
import importlib.util
import logging
import math
import os
import re
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NewType, Union, get_args, get_origin, get_type_hints

import msgspec
import yaml

from d9d.mesh import AUTO, D9dError, MeshConfig, MeshConfigError, resolve_auto_degree
from d9d.mesh.launch import launched_world_size
from d9d.parallel import PIPELINE_SCHEDULES, PipelineConfig, PipelineError
from d9d.trainer.config import JobConfig

__all__ = [
    "ConfigError",
    "ConfigPath",
    "LoadedJob",
    "apply_overrides",
    "check_job_settings",
    "check_values",
    "convert_section",
    "load_job_config",
    "resolve_object",
    "shards_parameters",
]

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`")


class ConfigError(D9dError, ValueError):
    """A job config cannot be used as written; the message names the key path and the fix."""


#: A path in a provider's config section: declare a field `ConfigPath` (or `ConfigPath | None`) in
#: the provider's `config_type` and the provider receives it absolute, taken from the config file's
#: directory like every path of a job (`LoadedJob.resolve_path`), so it can read the file at once.
ConfigPath = NewType("ConfigPath", str)


def resolve_config_paths(value: Any, loaded: "LoadedJob") -> Any:
    """`value` (a converted section: a msgspec struct) with each `ConfigPath` field made absolute,
    nested structs included; anything else is returned as it is."""
    if not isinstance(value, msgspec.Struct):
        return value
    changes: dict[str, Any] = {}
    for field in msgspec.structs.fields(type(value)):
        current = getattr(value, field.name)
        if isinstance(current, str) and _is_config_path(field.type):
            changes[field.name] = str(loaded.resolve_path(current))
        elif isinstance(current, msgspec.Struct):
            resolved = resolve_config_paths(current, loaded)
            if resolved is not current:
                changes[field.name] = resolved
    return msgspec.structs.replace(value, **changes) if changes else value


def _is_config_path(annotation: Any) -> bool:
    return annotation is ConfigPath or ConfigPath in get_args(annotation)


@dataclass(frozen=True)
class LoadedJob:
    """A parsed job config, where it came from, and its raw form (stored in checkpoints)."""

    config: JobConfig
    path: Path | None
    raw: dict[str, Any]
    #: The world a `mesh:` degree of `auto` was resolved for; None: the launch's (torchrun's WORLD_SIZE,
    #: 1 for a plain process). `raw` keeps `auto`, so a resumed run resolves it for its own world.
    world_size: int | None = None

    @property
    def base_dir(self) -> Path:
        """Directory that every relative path of the config is relative to: the config file's own
        (the working directory for a config given as a dict)."""
        return self.path.parent if self.path is not None else Path.cwd()

    def resolve_path(self, value: str | os.PathLike[str]) -> Path:
        """A path of the config as an absolute path: a relative one is taken from `base_dir`, so the
        same config names the same run, logs and export wherever the job is started from."""
        path = Path(value).expanduser()
        return Path(os.path.abspath(path if path.is_absolute() else self.base_dir / path))

    def with_overrides(self, overrides: Sequence[str]) -> "LoadedJob":
        """This job with more `key.path=value` overrides, checked as `load_job_config` checks them
        (the same file, so relative paths and providers resolve as before).

        Raises:
            ConfigError: an override is malformed, or the changed config breaks a key or a rule.
        """
        where = str(self.path) if self.path is not None else "config"
        return _parse(
            apply_overrides(self.raw, overrides), self.path, where, type(self.config), self.world_size
        )


def load_job_config(
    source: str | Path | dict[str, Any],
    overrides: Sequence[str] = (),
    *,
    schema: type = JobConfig,
    world_size: int | None = None,
) -> LoadedJob:
    """Parse a YAML file (or an already-parsed dict) with overrides into a `JobConfig`.

    A `mesh:` degree of `auto` becomes the rest of `world_size` after the other degrees
    (`d9d.mesh.resolve_auto_degree`); None: the launch's world (torchrun's WORLD_SIZE, else 1).

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed, or a key is unknown,
            mistyped or breaks a rule.
    """
    path: Path | None = None
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
        where = "config"
    else:
        path = Path(source)
        where = str(path)
        try:
            raw = _load_yaml(path.read_text(encoding="utf-8"), where)
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{where} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
                "save the config file as UTF-8"
            ) from None
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such config file; check the path") from None
        except IsADirectoryError:
            raise ConfigError(
                f"{where} is a directory, not a config file (a YAML file such as config.yaml)"
            ) from None
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read the config file: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None
        if raw is None:
            raise ConfigError(
                f"{where} is empty; a job needs at least the providers: and trainer: sections "
                "(`d9d init` writes a complete example)"
            )
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{where}: the top level must be a mapping of sections, got {type(raw).__name__}"
            )
    return _parse(apply_overrides(raw, overrides), path, where, schema, world_size)


def _parse(
    raw: dict[str, Any], path: Path | None, where: str, schema: type, world_size: int | None = None
) -> LoadedJob:
    """The job of a raw config (overrides applied): converted to `schema`, its values and rules checked."""
    config = convert_section(_with_auto_resolved(raw, where, world_size), schema, where=where, prefix="")
    check_values(config, where=where, prefix="")
    if isinstance(config, JobConfig):
        _check_rules(config, where)
    return LoadedJob(config=config, path=path, raw=raw, world_size=world_size)


def _with_auto_resolved(raw: dict[str, Any], where: str, world_size: int | None) -> dict[str, Any]:
    """`raw` with its `mesh:` degree of `auto` replaced by a number (`raw` itself is not changed)."""
    mesh = raw.get("mesh")
    if not isinstance(mesh, dict) or AUTO not in mesh.values():
        return raw
    world = world_size if world_size is not None else launched_world_size(os.environ)[0]
    try:
        return {**raw, "mesh": resolve_auto_degree(mesh, world)}
    except MeshConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _load_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load`, except that a key given twice in one mapping (at any depth) is an error."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, "", where)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_duplicate_keys(node: yaml.Node, path: str, where: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            child = path
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                child = _join(path, key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(
                        f"{where}: duplicate key {child} at lines {seen[key]} and {line}; "
                        "a key may appear only once in a section: keep one of them"
                    )
                seen[key] = line
            _check_duplicate_keys(value_node, child, where)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_duplicate_keys(item, f"{path}[{index}]", where)


#: Integers a checkpoint can store (as int64).
_INT64 = range(-(2**63), 2**63)


def check_values(value: Any, *, where: str, prefix: str) -> None:
    """Every value of a converted config can be saved and means something: no integer outside int64,
    no nan or infinite float, no NUL character in a string (a name or a path).

    Raises:
        ConfigError: naming the key path of the first such value.
    """
    key = prefix or "top level"
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if value not in _INT64:
            raise ConfigError(
                f"{where}: {key} must be an integer below 2**63 (a checkpoint stores it as a 64-bit "
                f"integer), got {value}"
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {key} must be a finite number, got {value}")
    elif isinstance(value, str):
        if "\x00" in value:
            raise ConfigError(
                f"{where}: {key} contains a NUL character (\\x00), which no name or path may hold; "
                f"remove it (got {value!r})"
            )
    elif isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            check_values(getattr(value, name), where=where, prefix=_join(prefix, name))
    elif isinstance(value, dict):
        for name, item in value.items():
            check_values(name, where=where, prefix=prefix)
            check_values(item, where=where, prefix=_join(prefix, str(name)))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_values(item, where=where, prefix=f"{prefix}[{index}]")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `key.path=value` set (values parsed as YAML scalars)."""
    result = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {item!r} must look like key.path=value, e.g. trainer.schedule.total_steps=400"
            )
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def convert_section(raw: Any, schema: type, *, where: str, prefix: str) -> Any:
    """Convert a raw (YAML) value into `schema`, turning msgspec's errors into one ConfigError line.

    A dataclass `schema` refuses unknown keys too (msgspec drops them; a Struct with
    `forbid_unknown_fields` refuses them at any depth)."""
    if dataclasses.is_dataclass(schema) and isinstance(raw, Mapping):
        names = [f.name for f in dataclasses.fields(schema)]
        unknown = [key for key in raw if key not in names]
        if unknown:
            hint = f"; valid keys here: {', '.join(names)}" if names else "; it takes no keys"
            raise ConfigError(f"{where}: unknown key {_join(prefix, str(unknown[0]))}{hint}")
    try:
        return msgspec.convert(raw, schema, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), schema, where=where, prefix=prefix)) from None


def _explain(message: str, schema: type, *, where: str, prefix: str) -> str:
    match = _AT.match(message.strip())
    assert match is not None
    text, at = match["msg"], match["path"] or ""
    key = _join(prefix, at.lstrip("."))
    unknown = _UNKNOWN.match(text)
    if unknown:
        full = _join(key, unknown["key"])
        fields = _fields_at(schema, at.lstrip("."))
        hint = f"; valid keys here: {', '.join(fields)}" if fields else ""
        return f"{where}: unknown key {full}{hint}"
    missing = re.match(r"Object missing required field `(?P<key>[^`]+)`", text)
    if missing:
        return f"{where}: missing required key {_join(key, missing['key'])}; add it to the config"
    if text.startswith("Invalid enum value"):
        choices = _choices_at(schema, at.lstrip("."))
        hint = f"; choose one of {', '.join(choices)}" if choices else ""
        return f"{where}: {key or 'top level'}: {text.replace('`', '')}{hint}"
    if text.startswith(("Expected", "Invalid")):
        return f"{where}: {key or 'top level'}: {text.replace('`', '')}"
    # a rule from a __post_init__: its message already names the key
    return f"{where}: {text}"


def _join(prefix: str, rest: str) -> str:
    return ".".join(p for p in (prefix, rest) if p)


def _type_at(schema: type, path: str) -> Any:
    """The annotated type found by walking `path` (dotted) through structs from `schema`; None if lost."""
    current: Any = schema
    for part in [p for p in re.split(r"[.\[\]]", path) if p]:
        current = _unwrap_optional(current)
        if part.isdigit() and get_origin(current) in (tuple, list):  # an item: the element type
            args = [a for a in get_args(current) if a is not Ellipsis]
            current = args[0] if len(args) == 1 else (args[int(part)] if int(part) < len(args) else None)
            continue
        if not (isinstance(current, type) and issubclass(current, msgspec.Struct)):
            return None
        hints = get_type_hints(current)
        if part not in hints:
            return None
        current = hints[part]
    return _unwrap_optional(current)


def _unwrap_optional(annotation: Any) -> Any:
    """`X` for `X | None` (the type a value must have when it is given at all)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _fields_at(schema: type, path: str) -> list[str]:
    """Field names of the struct found by walking `path` (dotted) from `schema`; [] if not a struct."""
    current = _type_at(schema, path)
    if isinstance(current, type) and issubclass(current, msgspec.Struct):
        return list(current.__struct_fields__)
    return []


def _choices_at(schema: type, path: str) -> list[str]:
    """The allowed values of the `Literal[...]` field at `path`; [] if it is not one."""
    current = _type_at(schema, path)
    if get_origin(current) is Literal:
        return [str(v) for v in get_args(current)]
    return []


def _check_rules(config: JobConfig, where: str) -> None:
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


def check_job_settings(loaded: LoadedJob) -> None:
    """The checks of a loaded job that need no provider: the directories it writes (no file in their
    way), settings that each are valid but do not work together (yet), and the dataset provider the
    built-in data provider needs.

    `resolve_job` runs them before it imports a provider; `run_job` before it checks the launch
    against the mesh, so they fail in the same order, without importing torch.

    Raises:
        ConfigError: naming the keys and the fix.
    """
    config = loaded.config
    where = str(loaded.path) if loaded.path is not None else "config"
    _check_directories(loaded, where)
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
    """The `eval:` section and `providers.eval_dataset` come together, and not with pipeline stages (yet)."""
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
    if config.eval is not None and config.mesh.pipeline_parallel > 1:
        raise ConfigError(
            f"{where}: eval: with mesh.pipeline_parallel={config.mesh.pipeline_parallel} is not supported yet "
            "(the pipeline schedules run training steps only); remove the eval: section or set "
            "mesh.pipeline_parallel: 1"
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


def _check_directories(loaded: LoadedJob, where: str) -> None:
    """Each directory the job writes must be a directory or creatable: no file may stand in its way."""
    config = loaded.config
    trainer = config.trainer
    tracking, profiling = trainer.tracking, trainer.profiling
    targets = {
        "trainer.checkpointing.save_dir": str(Path(trainer.checkpointing.save_dir) / trainer.run.name),
        "trainer.logging.log_dir": trainer.logging.log_dir,
        "export.dir": config.export.dir,
        "trainer.profiling.dir": profiling.dir if profiling.active_steps else None,
        "trainer.tracking.tensorboard_dir": tracking.tensorboard_dir
        if "tensorboard" in tracking.backends
        else None,
        "trainer.tracking.wandb_dir": tracking.wandb_dir if "wandb" in tracking.backends else None,
    }
    for key, target in targets.items():
        if target is None:
            continue
        blocker = _file_in_the_way(loaded.resolve_path(target))
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
