"""Per-file checksums of a checkpoint: computed by the rank that wrote a file, right after writing it.

Every rank checksums the files it wrote itself: its torch.distributed.checkpoint shards (read back
once the DCP writer closed them, on the writer's own thread, so an asynchronous save computes them
off the training path) and its msgpack files (from the bytes in memory). The committing rank records
them in the commit record, `CheckpointMeta.checksums`, as `crc32:<8 hex digits>` (zlib's CRC-32:
it detects every burst error up to 32 bits, so every flipped byte). Checkpoints written before d9d
recorded checksums have `checksums=None`: they load, and verification says they have none.
"""

import zlib
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = [
    "ALGORITHM",
    "ChecksummingWriter",
    "WrittenFile",
    "check_checksums",
    "checksum_bytes",
    "checksum_file",
]

#: The algorithm prefix of every recorded checksum.
ALGORITHM = "crc32"
#: What a rank reports of a file it wrote: (size in bytes, checksum).
WrittenFile = tuple[int, str]

_CHUNK = 8 << 20
_METADATA_FILE = ".metadata"  # written by DCP's coordinator in `finish`


def checksum_bytes(data: bytes | bytearray | memoryview) -> str:
    """The checksum of bytes in memory, as recorded in a commit record."""
    return f"{ALGORITHM}:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def checksum_file(path: Path) -> str:
    """The checksum of a file, read in chunks (memory stays at one chunk)."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)  # releases the GIL on large chunks
    return f"{ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


def check_checksums(path: Path, checksums: Mapping[str, str], names: set[str] | None = None) -> list[str]:
    """The files of `checksums` (or only `names`) whose content no longer matches, as problem lines."""
    problems = []
    label = path.name
    for name, expected in sorted(checksums.items()):
        if names is not None and name not in names:
            continue
        if not expected.startswith(f"{ALGORITHM}:"):
            problems.append(
                f"{label}/{name} has a checksum of an unknown kind ({expected}); cannot verify it"
            )
            continue
        try:
            actual = checksum_file(path / name)
        except OSError as exc:
            problems.append(f"{label}/{name} cannot be read ({exc})")
            continue
        if actual != expected:
            problems.append(f"{label}/{name} is damaged (checksum mismatch)")
    return problems


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
        self._record(_METADATA_FILE)

    def _record(self, name: str) -> None:
        file = Path(self.path) / name
        self.written[name] = (file.stat().st_size, checksum_file(file))
