"""Read a job's YAML file (plus `--set key.path=value` overrides) into a checked `JobConfig`.

Everything that can be wrong with a config alone fails here, once, before any process group, file or
model exists: YAML syntax, a key given twice, unknown keys, wrong types, values no checkpoint can
store (`d9d.trainer.job.convert`) and the rules across keys, directories included
(`d9d.trainer.job.rules`). Each error is one `ConfigError` line naming the file, the key path and the
fix. Resolving the providers the config names is `d9d.trainer.job.resolve`'s.
"""

import copy
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from d9d.mesh import AUTO, MeshConfigError, resolve_auto_degree
from d9d.mesh.launch import launched_world_size
from d9d.trainer.config.job import JobConfig
from d9d.trainer.errors import ConfigError
from d9d.trainer.job.convert import check_values, convert_section, join_key
from d9d.trainer.job.paths import JobPaths, resolve_path
from d9d.trainer.job.rules import check_job_settings, check_rules

__all__ = ["LoadedJob", "apply_overrides", "load_job_config"]


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

    @property
    def where(self) -> str:
        """How error messages name this config: its file, or "config" for one given as a dict."""
        return str(self.path) if self.path is not None else "config"

    @functools.cached_property
    def paths(self) -> JobPaths:
        """The directories the job writes, resolved once from `base_dir`."""
        return JobPaths.of(self.config, self.base_dir)

    def resolve_path(self, value: str | os.PathLike[str]) -> Path:
        """A path of the config as an absolute path: a relative one is taken from `base_dir`, so the
        same config names the same run, logs and export wherever the job is started from."""
        return resolve_path(self.base_dir, value)

    def with_overrides(self, overrides: Sequence[str]) -> "LoadedJob":
        """This job with more `key.path=value` overrides, checked as `load_job_config` checks them
        (the same file, so relative paths and providers resolve as before).

        Raises:
            ConfigError: an override is malformed, or the changed config breaks a key or a rule.
        """
        return _parse(apply_overrides(self.raw, overrides), self.path, type(self.config), self.world_size)


def load_job_config(
    source: str | Path | dict[str, Any],
    overrides: Sequence[str] = (),
    *,
    schema: type = JobConfig,
    world_size: int | None = None,
    config_path: Path | None = None,
) -> LoadedJob:
    """Parse a YAML file (or an already-parsed dict) with overrides into a `JobConfig`, checked.

    A `mesh:` degree of `auto` becomes the rest of `world_size` after the other degrees
    (`d9d.mesh.resolve_auto_degree`); None: the launch's world (torchrun's WORLD_SIZE, else 1).
    `config_path`: for a dict, the file it stands for (its relative paths are taken from that file's
    directory, and errors name it: e.g. a config stored in a checkpoint).

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed, or a key is unknown,
            mistyped or breaks a rule.
    """
    if isinstance(source, dict):
        raw, path = copy.deepcopy(source), config_path
    else:
        path = Path(source)
        raw = _read_file(path)
    return _parse(apply_overrides(raw, overrides), path, schema, world_size)


def _read_file(path: Path) -> dict[str, Any]:
    """The mapping of sections in the YAML file `path`."""
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
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def _parse(raw: dict[str, Any], path: Path | None, schema: type, world_size: int | None) -> LoadedJob:
    """The job of a raw config (overrides applied): converted to `schema`, its values, rules and
    settings checked (the one pass every path of a job runs)."""
    where = str(path) if path is not None else "config"
    config = convert_section(_with_auto_resolved(raw, where, world_size), schema, where=where, prefix="")
    check_values(config, where=where, prefix="")
    loaded = LoadedJob(config=config, path=path, raw=raw, world_size=world_size)
    if isinstance(config, JobConfig):
        check_rules(config, where)
        check_job_settings(config, loaded.paths, where)
    return loaded


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
                child = join_key(path, key_node.value)
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
