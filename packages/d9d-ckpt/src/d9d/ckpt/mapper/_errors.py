"""Exception and warning types of state mappers."""

from collections.abc import Iterable

from d9d.mesh import D9dError

__all__ = ["MappingError", "NotInvertibleError", "UnusedKeysWarning", "format_keys"]


class MappingError(D9dError, ValueError):
    """A mapper is malformed or does not fit the state it is applied to (missing, colliding keys...)."""


class NotInvertibleError(MappingError):
    """`inverse()` was asked of a transform that loses information (drop, reshape without a source shape...)."""


class UnusedKeysWarning(UserWarning):
    """Keys of a state that no group of a mapper consumes (raised as an error unless asked to warn)."""


def format_keys(keys: Iterable[str], limit: int = 12) -> str:
    """Sorted keys for a message, cut after `limit` with a count of the rest."""
    ordered = sorted(keys)
    shown = ", ".join(repr(k) for k in ordered[:limit])
    more = f", ... (+{len(ordered) - limit} more)" if len(ordered) > limit else ""
    return f"[{shown}{more}]"
