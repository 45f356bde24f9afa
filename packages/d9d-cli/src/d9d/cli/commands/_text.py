"""Small text formatting and parsing shared by the commands."""

import re
from decimal import Decimal

from d9d.mesh import format_size  # the one writer of sizes, here for the commands

__all__ = ["format_size", "parse_size"]

#: Bytes per unit: binary (KiB = 1024) and decimal (KB = 1000), as disk and GPU vendors write them.
_UNITS = {
    "b": 1,
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")},
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")},
}
_SIZE = re.compile(r"^\s*(?P<number>[-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A positive size in bytes from `80GiB`, `24GB`, `512 MiB`, `1.5TiB` or a plain byte count.

    KiB, MiB, GiB, TiB, PiB are powers of 1024; KB, MB, GB, TB, PB powers of 1000; B or no unit is
    bytes (units in any case). A fraction is rounded down to whole bytes.

    Raises:
        ValueError: not a size, an unknown or ambiguous unit (`80G`), or not above zero; the message
            says what to write.
    """
    match = _SIZE.match(text)
    example = "e.g. 80GiB, 24GB, 512MiB or a number of bytes"
    if match is None:
        raise ValueError(f"{text!r} is not a size: write a number and a unit, {example}")
    number, unit = match.group("number"), match.group("unit").lower()
    if unit in ("k", "m", "g", "t", "p"):
        raise ValueError(
            f"{text!r}: {unit.upper()} is ambiguous: write {number}{unit.upper()}iB (powers of 1024) "
            f"or {number}{unit.upper()}B (powers of 1000)"
        )
    if unit and unit not in _UNITS:
        raise ValueError(
            f"{text!r}: unknown unit {match.group('unit')!r}: use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB "
            f"({example})"
        )
    if unit in ("", "b") and "." in number:
        raise ValueError(f"{text!r}: a number of bytes is a whole number ({example})")
    size = int(Decimal(number) * _UNITS[unit or "b"])  # exact: 0.1GB is 100000000 bytes
    if size <= 0:
        raise ValueError(f"{text!r}: the size must be above zero ({example})")
    return size
