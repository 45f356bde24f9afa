"""torch.distributed.checkpoint's file-system storage with d9d's integrity checks built in.

`ChecksummingWriter` checksums every file a rank wrote right after writing it (the checksums its
commit records, see `integrity.py`); `KnownMetadataReader` hands a load the DCP metadata one rank
read and broadcast, so the other ranks open only their own shards.
"""

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from d9d.ckpt.checkpoint.integrity import METADATA_FILE, WrittenFile, checksum_file

__all__ = ["ChecksummingWriter", "KnownMetadataReader"]


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer that checksums each file this rank wrote, right after writing it.

    `written` maps each file (relative to the checkpoint directory) to its size and checksum; on
    the coordinator it includes `.metadata` once `finish` wrote it.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.written: dict[str, WrittenFile] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shards (DCP's writer), then checksum every file they landed in."""
        future = super().write_data(plan, planner)
        results: list[WriteResult] = future.wait()  # DCP's file writer returns a completed future
        for name in sorted({r.storage_data.relative_path for r in results}):
            self._record(name)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write `.metadata` (DCP's writer, on the coordinator), then checksum it."""
        super().finish(metadata, results)
        self._record(METADATA_FILE)

    def _record(self, name: str) -> None:
        file = Path(self.path) / name
        self.written[name] = (file.stat().st_size, checksum_file(file))


class KnownMetadataReader(FileSystemReader):
    """A `FileSystemReader` of one checkpoint that returns metadata read before (and broadcast).

    `dcp.load` otherwise opens `.metadata` on every rank; with this reader only the shard files a
    rank needs are opened.
    """

    def __init__(self, path: str | Path, metadata: Metadata) -> None:
        super().__init__(str(path))
        self._known = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The known metadata (a per-rank metadata file, `rank=`, is still read from disk)."""
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        metadata = self._known
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata
