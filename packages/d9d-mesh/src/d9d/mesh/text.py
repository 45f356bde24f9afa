"""How every d9d package writes a size and an exception in one line (no torch: commands that only read
a config or a run directory use them too)."""

__all__ = ["first_line", "format_size", "one_line"]


def format_size(n: float) -> str:
    """Bytes in binary units, one decimal above 1 KiB (`512 B`, `12.3 MiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 200 characters (its type's name when empty)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def one_line(exc: BaseException) -> str:
    """An exception's whole message on one line: its lines stripped and joined (its type's name when empty)."""
    text = str(exc) or type(exc).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or type(exc).__name__
