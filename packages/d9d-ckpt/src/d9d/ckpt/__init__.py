"""d9d.ckpt: state mappers, streaming safetensors IO (HF layout) and crash-safe sharded checkpoints.

See packages/d9d-ckpt/README.md. Mappers live in `d9d.ckpt.mapper`, safetensors IO in `d9d.ckpt.io`,
checkpoints in `d9d.ckpt.checkpoint`; every public name is re-exported here.

The names load on first use (PEP 562): `read_checkpoint_info`, `list_checkpoints` and
`verify_checkpoint` read commit records and file bytes without importing torch, so `d9d checkpoints`
stays fast; the mappers, safetensors IO and `CheckpointManager` import it.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from d9d.ckpt.checkpoint import (
        CheckpointDamagedError,
        CheckpointDiskFullError,
        CheckpointError,
        CheckpointInfo,
        CheckpointManager,
        CheckpointMeta,
        CheckpointVerification,
        FileProblem,
        FileProblemKind,
        LoadedCheckpoint,
        RunEntryKind,
        SaveDirNotSharedError,
        capture_rng_state,
        check_checkpoint_files,
        classify_run_entry,
        list_checkpoints,
        read_checkpoint_info,
        restore_rng_state,
        uncommitted_step_dirs,
        verify_checkpoint,
    )
    from d9d.ckpt.io import (
        SafetensorsIOError,
        check_safetensors,
        load_safetensors,
        safetensors_fingerprint,
        safetensors_shapes,
        save_safetensors,
    )
    from d9d.ckpt.mapper import (
        Cast,
        Chunk,
        Concat,
        Deduplicate,
        Drop,
        Duplicate,
        Identity,
        MappingError,
        MappingGroup,
        NotInvertibleError,
        OnUnused,
        Parallel,
        Prefix,
        Rename,
        Reshape,
        RopePermute,
        SelectOutputs,
        Sequential,
        Stack,
        StateMapper,
        Transpose,
        Unstack,
        UnusedKeysWarning,
        apply_mapper,
        check_mapper,
        identity_map,
        rename_pattern,
    )

#: Subpackage → the public names it exports (the run-time twin of the imports above; a test keeps them
#: equal).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "checkpoint": (
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
        "list_checkpoints",
        "read_checkpoint_info",
        "restore_rng_state",
        "uncommitted_step_dirs",
        "verify_checkpoint",
    ),
    "io": (
        "SafetensorsIOError",
        "check_safetensors",
        "load_safetensors",
        "safetensors_fingerprint",
        "safetensors_shapes",
        "save_safetensors",
    ),
    "mapper": (
        "Cast",
        "Chunk",
        "Concat",
        "Deduplicate",
        "Drop",
        "Duplicate",
        "Identity",
        "MappingError",
        "MappingGroup",
        "NotInvertibleError",
        "OnUnused",
        "Parallel",
        "Prefix",
        "Rename",
        "Reshape",
        "RopePermute",
        "SelectOutputs",
        "Sequential",
        "Stack",
        "StateMapper",
        "Transpose",
        "Unstack",
        "UnusedKeysWarning",
        "apply_mapper",
        "check_mapper",
        "identity_map",
        "rename_pattern",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__: list[str] = [
    "Cast",
    "CheckpointDamagedError",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMeta",
    "CheckpointVerification",
    "Chunk",
    "Concat",
    "Deduplicate",
    "Drop",
    "Duplicate",
    "FileProblem",
    "FileProblemKind",
    "Identity",
    "LoadedCheckpoint",
    "MappingError",
    "MappingGroup",
    "NotInvertibleError",
    "OnUnused",
    "Parallel",
    "Prefix",
    "Rename",
    "Reshape",
    "RopePermute",
    "RunEntryKind",
    "SafetensorsIOError",
    "SaveDirNotSharedError",
    "SelectOutputs",
    "Sequential",
    "Stack",
    "StateMapper",
    "Transpose",
    "Unstack",
    "UnusedKeysWarning",
    "apply_mapper",
    "capture_rng_state",
    "check_checkpoint_files",
    "check_mapper",
    "check_safetensors",
    "classify_run_entry",
    "identity_map",
    "list_checkpoints",
    "load_safetensors",
    "read_checkpoint_info",
    "rename_pattern",
    "restore_rng_state",
    "safetensors_fingerprint",
    "safetensors_shapes",
    "save_safetensors",
    "uncommitted_step_dirs",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Import a public name's subpackage on first use (PEP 562) and keep the name here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'd9d.ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"d9d.ckpt.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
