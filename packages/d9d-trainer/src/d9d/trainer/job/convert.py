"""A raw (YAML) value into a config struct, with msgspec's errors turned into one line naming the key path.

Also the values no struct can refuse alone: an integer a checkpoint cannot store, a nan, a NUL in a name.
"""

import dataclasses
import math
import re
import types
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from d9d.trainer.errors import ConfigError

__all__ = ["check_values", "convert_section", "join_key"]

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<key>[^`]+)`")


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
            check_values(getattr(value, name), where=where, prefix=join_key(prefix, name))
    elif isinstance(value, dict):
        for name, item in value.items():
            check_values(name, where=where, prefix=prefix)
            check_values(item, where=where, prefix=join_key(prefix, str(name)))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_values(item, where=where, prefix=f"{prefix}[{index}]")


def convert_section(raw: Any, schema: type, *, where: str, prefix: str) -> Any:
    """Convert a raw (YAML) value into `schema`, turning msgspec's errors into one ConfigError line.

    A dataclass `schema` refuses unknown keys too (msgspec drops them; a Struct with
    `forbid_unknown_fields` refuses them at any depth)."""
    if dataclasses.is_dataclass(schema) and isinstance(raw, Mapping):
        names = [f.name for f in dataclasses.fields(schema)]
        unknown = [key for key in raw if key not in names]
        if unknown:
            hint = f"; valid keys here: {', '.join(names)}" if names else "; it takes no keys"
            raise ConfigError(f"{where}: unknown key {join_key(prefix, str(unknown[0]))}{hint}")
    try:
        return msgspec.convert(raw, schema, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), schema, where=where, prefix=prefix)) from None


def _explain(message: str, schema: type, *, where: str, prefix: str) -> str:
    match = _AT.match(message.strip())
    assert match is not None
    text, at = match["msg"], match["path"] or ""
    key = join_key(prefix, at.lstrip("."))
    unknown = _UNKNOWN.match(text)
    if unknown:
        full = join_key(key, unknown["key"])
        fields = _fields_at(schema, at.lstrip("."))
        hint = f"; valid keys here: {', '.join(fields)}" if fields else ""
        return f"{where}: unknown key {full}{hint}"
    missing = re.match(r"Object missing required field `(?P<key>[^`]+)`", text)
    if missing:
        return f"{where}: missing required key {join_key(key, missing['key'])}; add it to the config"
    if text.startswith("Invalid enum value"):
        choices = _choices_at(schema, at.lstrip("."))
        hint = f"; choose one of {', '.join(choices)}" if choices else ""
        return f"{where}: {key or 'top level'}: {text.replace('`', '')}{hint}"
    if text.startswith(("Expected", "Invalid")):
        return f"{where}: {key or 'top level'}: {text.replace('`', '')}"
    # a rule from a __post_init__: its message already names the key
    return f"{where}: {text}"


def join_key(prefix: str, rest: str) -> str:
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
