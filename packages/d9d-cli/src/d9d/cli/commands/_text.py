"""Small text formatting shared by the commands."""

__all__ = ["format_size"]


def format_size(n: float) -> str:
    """Bytes in binary units, one decimal above 1 KiB (`512 B`, `12.3 MiB`)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
