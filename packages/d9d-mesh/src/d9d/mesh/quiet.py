"""Notices libraries print to their own authors, kept off a user's console.

A notice here is one a d9d user can do nothing about (it asks a library to change its code), printed
on every import, on every rank: on a one-line error it doubles what the user reads. Each is dropped
by a `logging.Filter` on the logger that emits it, matched by its message format, so any other
record of that logger still gets through. Installed when `d9d.mesh` is imported (every d9d package
imports it first). Imports nothing but `logging`.
"""

import logging

__all__ = ["quiet_library_notices"]

#: logger name -> the start of the message format it emits (`record.msg`, before % formatting).
_NOTICES: dict[str, tuple[str, ...]] = {
    # torch 2.15 warns when a library (torchao, imported by transformers too) registers an Enum
    # as a pytree constant, which torchao does at import.
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


class _DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.starts))


def quiet_library_notices() -> None:
    """Install the filters (idempotent)."""
    for name, starts in _NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotices) for f in logger.filters):
            logger.addFilter(_DropNotices(starts))
