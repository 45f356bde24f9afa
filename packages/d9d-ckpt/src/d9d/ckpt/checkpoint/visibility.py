"""The commit's check that every rank's files are visible to the committing rank (a shared `save_dir`).

Each rank reports the files it wrote (name, size, checksum). Rank 0 stats each of them by name in
its own view of the save directory before it writes the commit record: on a `save_dir` that is
local to each node (or mounted differently), another node's shards are not there, and committing
would give a checkpoint that no job can load. A network file system may show a new file a moment
late, so a missing file is looked up again a few times (about a second in all) before the save
fails.
"""

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from d9d.ckpt.checkpoint.errors import SaveDirNotSharedError
from d9d.ckpt.checkpoint.integrity import WrittenFile, checksum_file
from d9d.ckpt.checkpoint.layout import COMMIT_FILE

__all__ = ["collect_files", "not_shared_message", "unseen_files"]

_RETRY_DELAYS_S = (0.1, 0.3, 0.6)
_LISTED = 3


def unseen_files(directory: Path, reported: Sequence[Mapping[str, WrittenFile]]) -> dict[int, list[str]]:
    """Per rank, the files it reported that are missing here or have another size (empty: all seen)."""
    unseen: dict[int, list[str]] = {}
    for rank, files in enumerate(reported):
        for name, (size, _) in sorted(files.items()):
            try:
                seen = os.stat(directory / name).st_size
            except FileNotFoundError:
                unseen.setdefault(rank, []).append(f"{name} is missing")
                continue
            if seen != size:
                unseen.setdefault(rank, []).append(f"{name} has {seen} of its {size} bytes")
    return unseen


def not_shared_message(save_dir: Path, directory: Path, rank: int, unseen: list[str]) -> str:
    """The error of a save whose files of `rank` are not visible to rank 0."""
    listed = "; ".join(unseen[:_LISTED]) + (
        f"; and {len(unseen) - _LISTED} more" if len(unseen) > _LISTED else ""
    )
    return (
        f"save_dir {save_dir} is not on a file system shared by all nodes (rank {rank}'s files are not "
        f"visible to rank 0); put trainer.checkpointing.save_dir on a shared file system "
        f"(in {directory} as rank 0 sees it: {listed}); nothing was committed, the previous checkpoint "
        "stays the latest"
    )


def collect_files(
    directory: Path, reported: Sequence[Mapping[str, WrittenFile]], save_dir: Path
) -> dict[str, WrittenFile]:
    """Every file of the save in `directory` with its size and checksum, as the committing rank sees it.

    `reported` holds, per rank, the files that rank wrote. Files no rank reported (e.g. an empty
    shard) are checksummed here.

    Raises:
        SaveDirNotSharedError: naming the first rank whose files this rank does not see.
    """
    for delay in (*_RETRY_DELAYS_S, None):
        unseen = unseen_files(directory, reported)
        if not unseen:
            break
        if delay is None:
            rank = min(unseen)
            raise SaveDirNotSharedError(not_shared_message(save_dir, directory, rank, unseen[rank]))
        time.sleep(delay)
    files: dict[str, WrittenFile] = {}
    for rank_files in reported:
        files.update(rank_files)
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != COMMIT_FILE:
            name = path.relative_to(directory).as_posix()
            if name not in files:
                files[name] = (path.stat().st_size, checksum_file(path))
    return dict(sorted(files.items()))
