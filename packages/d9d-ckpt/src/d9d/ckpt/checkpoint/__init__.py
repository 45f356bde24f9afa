"""Crash-safe sharded checkpoints of a run: `save-<step>/` directories, resume discovery, retention.

from d9d.ckpt import CheckpointManager, capture_rng_state

manager = CheckpointManager("runs", "my-run", num_to_keep=3)
manager.save(step, model, optimizer, extra_state={"data": data_state}, rank_state=capture_rng_state())
loaded = manager.load(manager.latest(), model, optimizer)

Every commit records a checksum per file; `CheckpointManager(..., verify_on_load=True)` and
`verify_checkpoint(info)` compare them (`integrity.py`). `classify_run_entry` tells the names of a
run directory apart (`layout.py`).
"""

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
    read_checkpoint_info,
)
from d9d.ckpt.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from d9d.ckpt.checkpoint.rng import capture_rng_state, restore_rng_state

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
    "LoadedCheckpoint",
    "RunEntryKind",
    "SaveDirNotSharedError",
    "capture_rng_state",
    "check_checkpoint_files",
    "classify_run_entry",
    "read_checkpoint_info",
    "restore_rng_state",
    "verify_checkpoint",
]
