"""Crash-safe sharded checkpoints of a run: `save-<step>/` directories, resume discovery, retention.

from d9d.ckpt import CheckpointManager, capture_rng_state

manager = CheckpointManager("runs", "my-run", num_to_keep=3)
manager.save(step, model, optimizer, extra_state={"data": data_state}, rank_state=capture_rng_state())
loaded = manager.load(manager.latest(), model, optimizer)

Every commit records a checksum per file; `CheckpointManager(..., verify_on_load=True)` and
`verify_checkpoint(info)` compare them (`integrity.py`). `classify_run_entry` tells the names of a
run directory apart, `list_checkpoints` lists a run's committed checkpoints (`layout.py`).

The names load on first use (PEP 562): listing a run and verifying its files read only the commit
records and the files' bytes, without importing torch; `CheckpointManager` and the RNG state import it.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from d9d.ckpt.checkpoint.best import KeepBest, best_checkpoints, metric_of
    from d9d.ckpt.checkpoint.errors import (
        CheckpointDamagedError,
        CheckpointDiskFullError,
        CheckpointError,
        SaveDirNotSharedError,
    )
    from d9d.ckpt.checkpoint.integrity import (
        CheckpointVerification,
        FileProblem,
        FileProblemKind,
        check_checkpoint_files,
        verify_checkpoint,
    )
    from d9d.ckpt.checkpoint.layout import (
        CheckpointInfo,
        CheckpointMeta,
        RunEntryKind,
        classify_run_entry,
        list_checkpoints,
        read_checkpoint_info,
        uncommitted_step_dirs,
    )
    from d9d.ckpt.checkpoint.load import LoadedCheckpoint
    from d9d.ckpt.checkpoint.manager import CheckpointManager
    from d9d.ckpt.checkpoint.rng import capture_rng_state, restore_rng_state

#: Module → the public names it defines (the run-time twin of the imports above; a test keeps them equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "best": ("KeepBest", "best_checkpoints", "metric_of"),
    "errors": (
        "CheckpointDamagedError",
        "CheckpointDiskFullError",
        "CheckpointError",
        "SaveDirNotSharedError",
    ),
    "integrity": (
        "CheckpointVerification",
        "FileProblem",
        "FileProblemKind",
        "check_checkpoint_files",
        "verify_checkpoint",
    ),
    "layout": (
        "CheckpointInfo",
        "CheckpointMeta",
        "RunEntryKind",
        "classify_run_entry",
        "list_checkpoints",
        "read_checkpoint_info",
        "uncommitted_step_dirs",
    ),
    "load": ("LoadedCheckpoint",),
    "manager": ("CheckpointManager",),
    "rng": ("capture_rng_state", "restore_rng_state"),
}
_MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562

__all__ = [
    "CheckpointDamagedError",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMeta",
    "CheckpointVerification",
    "FileProblem",
    "FileProblemKind",
    "KeepBest",
    "LoadedCheckpoint",
    "RunEntryKind",
    "SaveDirNotSharedError",
    "best_checkpoints",
    "capture_rng_state",
    "check_checkpoint_files",
    "classify_run_entry",
    "list_checkpoints",
    "metric_of",
    "read_checkpoint_info",
    "restore_rng_state",
    "uncommitted_step_dirs",
    "verify_checkpoint",
]
