"""What a prepare shows while it runs and when it ends: a progress line on a terminal and a summary."""

import sys
import time
from typing import IO

from d9d.data.prepare.index import PreparedIndex

__all__ = ["Progress", "summary"]


class Progress:
    """A progress line on a terminal (source bytes read, tokens/s, time left)."""

    def __init__(self, total_bytes: int, stream: IO[str], *, enabled: bool) -> None:
        self._total = max(total_bytes, 1)
        self._stream = stream
        self._tty = enabled and stream.isatty()
        self._bytes = self._tokens = 0
        self._start = time.monotonic()
        self._fresh_bytes = self._fresh_tokens = 0  # this run's work, for the rate
        self._shown = False

    def advance(self, nbytes: int, ntokens: int, *, fresh: bool = True) -> None:
        """Count source bytes read and tokens written (`fresh=False`: kept from before, not in the rate)."""
        self._bytes += nbytes
        self._tokens += ntokens
        if fresh:
            self._fresh_bytes += nbytes
            self._fresh_tokens += ntokens
        if self._tty:
            elapsed = max(time.monotonic() - self._start, 1e-9)
            rate = self._fresh_bytes / elapsed
            left = (self._total - self._bytes) / rate if rate > 0 else float("nan")
            fraction = min(self._bytes / self._total, 1.0)
            filled = int(fraction * 30)
            eta = f"{left:5.0f}s" if left == left else "    ?"
            self._stream.write(
                f"\rpreparing [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%}  {self._tokens:,} tokens  "
                f"{self._fresh_tokens / elapsed:,.0f} tokens/s  eta {eta} "
            )
            self._stream.flush()
            self._shown = True

    def close(self) -> None:
        """End the line, when one was shown."""
        if self._tty and self._shown:
            self._stream.write("\n")
            self._stream.flush()


def summary(
    stream: IO[str] | None, enabled: bool, index: PreparedIndex, seconds: float, *, reused: int
) -> None:
    """One line on what the prepare made (on `stream`, default stderr); `reused` shards were kept."""
    if not enabled:
        return
    stream = stream or sys.stderr
    kept = f", {reused} of them kept from before" if reused else ""
    rate = f" in {seconds:.1f} s ({index.tokens / max(seconds, 1e-9):,.0f} tokens/s)" if seconds > 0 else ""
    docs, shards = index.documents, len(index.shards)
    stream.write(
        f"prepared {docs:,} document{'s' * (docs != 1)}, {index.tokens:,} tokens ({index.dtype}, tokenizer "
        f"{index.tokenizer}) in {shards} shard{'s' * (shards != 1)}{kept}{rate}\n"
    )
    stream.flush()
