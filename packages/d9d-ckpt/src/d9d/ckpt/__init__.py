"""d9d.ckpt: state mappers, streaming safetensors IO (HF layout) and crash-safe sharded checkpoints.

See packages/d9d-ckpt/README.md. Mappers live in `d9d.ckpt.mapper`, safetensors IO in `d9d.ckpt.io`,
checkpoints in `d9d.ckpt.checkpoint`; every public name is re-exported here.

The names load on first use (PEP 562): `read_checkpoint_info`, `list_checkpoints` and
`verify_checkpoint` read commit records and file bytes without importing torch, so `d9d checkpoints`
stays fast; the mappers, safetensors IO and `CheckpointManager` import it.
"""

from typing import TYPE_CHECKING

from d9d.mesh.lazy import lazy_face

if TYPE_CHECKING:  # the public names, listed once: `lazy_face` reads this block
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
    from d9d.ckpt.io._errors import SafetensorsIOError
    from d9d.ckpt.io._fingerprint import safetensors_fingerprint
    from d9d.ckpt.io._read import check_safetensors, load_safetensors, safetensors_shapes
    from d9d.ckpt.io._stream import StreamDestination, stream_weights
    from d9d.ckpt.io._write import save_safetensors
    from d9d.ckpt.mapper._base import MappingGroup, StateMapper
    from d9d.ckpt.mapper._check import OnUnused, apply_mapper, check_mapper
    from d9d.ckpt.mapper._compose import Parallel, Prefix, SelectOutputs, Sequential
    from d9d.ckpt.mapper._errors import MappingError, NotInvertibleError, UnusedKeysWarning
    from d9d.ckpt.mapper._rename import (
        Deduplicate,
        Drop,
        Duplicate,
        Identity,
        Rename,
        identity_map,
        rename_pattern,
    )
    from d9d.ckpt.mapper._split import Chunk, Concat, Stack, Unstack
    from d9d.ckpt.mapper._tensor import Cast, Reshape, RopePermute, Transpose

__all__, __getattr__, __dir__ = lazy_face(__name__, globals())
