"""Verification of a committed checkpoint's files: sizes and checksums against its commit record.

`verify_checkpoint` reads every file of one checkpoint (what `d9d checkpoints --verify` runs per
checkpoint); `CheckpointManager(verify_on_load=True)` runs the same checks on rank 0 before a load.
"""

import os
from dataclasses import dataclass

from d9d.ckpt.checkpoint.checksum import check_checksums
from d9d.ckpt.checkpoint.layout import CheckpointInfo, recovery_hint
from d9d.ckpt.checkpoint.validate import check_files

__all__ = ["CheckpointVerification", "verify_checkpoint"]


@dataclass(frozen=True)
class CheckpointVerification:
    """The outcome of verifying one checkpoint.

    Attributes:
        problems: one line per damaged file (`save-4/<file> is damaged (checksum mismatch)`, ...).
        has_checksums: False for a checkpoint written before d9d recorded checksums: only the file
            sizes were checked.
        recovery: how to get past the damage (`move save-4 aside to resume from save-2`), None if ok.
    """

    info: CheckpointInfo
    problems: list[str]
    has_checksums: bool
    recovery: str | None

    @property
    def ok(self) -> bool:
        """True when no damage was found."""
        return not self.problems


def verify_checkpoint(info: CheckpointInfo) -> CheckpointVerification:
    """Check every file of a committed checkpoint against its recorded size and checksum (reads them all)."""
    checksums = info.meta.checksums
    problems = check_files(info.path, info.meta)
    if checksums is not None:
        problems += check_checksums(info.path, checksums, _sizes_intact(info))
    return CheckpointVerification(
        info=info,
        problems=problems,
        has_checksums=checksums is not None,
        recovery=recovery_hint(info.path) if problems else None,
    )


def _sizes_intact(info: CheckpointInfo) -> set[str]:
    """The files whose size is the recorded one (the others are already reported by `check_files`)."""
    intact = set()
    for name, size in info.meta.files.items():
        try:
            if os.stat(info.path / name).st_size == size:
                intact.add(name)
        except OSError:
            pass
    return intact
