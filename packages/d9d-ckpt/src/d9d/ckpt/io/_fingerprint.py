"""A cheap fingerprint of a safetensors folder: which weights `load_safetensors` would read."""

import hashlib
import os
import struct
from pathlib import Path

from d9d.ckpt.io._errors import SafetensorsIOError
from d9d.ckpt.io._layout import SINGLE_FILE, read_layout

#: Bytes read from each file's data at each sampled place, and how many places besides its ends.
_BLOCK = 64 * 2**10
_PLACES = 16


def safetensors_fingerprint(directory: str | os.PathLike[str]) -> str:
    """A hex digest of the files `load_safetensors(directory)` reads: their names, sizes, headers
    (every tensor's name, dtype, shape and offsets) and samples of their data (the first and last
    64 KiB and 16 evenly spaced 64 KiB blocks of each file's tensor bytes).

    It tells another model, another layout or another training of the same architecture apart (a
    fine-tune changes every weight) while reading a few MiB however large the folder. A change
    confined to bytes between the samples goes unnoticed.

    Raises:
        SafetensorsIOError: a file is missing or is not a safetensors file.
    """
    folder = Path(directory)
    weight_map = read_layout(folder)
    names = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
    digest = hashlib.sha256()
    for name in names:
        path = folder / name
        try:
            with path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                head = fh.read(8)
                if len(head) != 8:
                    raise SafetensorsIOError(f"{path} is not a safetensors file (shorter than its header)")
                (length,) = struct.unpack("<Q", head)
                if 8 + length > size:
                    raise SafetensorsIOError(f"{path} is not a safetensors file (truncated header)")
                digest.update(f"{name}\0{size}\0".encode())
                digest.update(fh.read(length))
                start, end = 8 + length, size
                span = max(end - start - _BLOCK, 0)
                for offset in sorted(
                    {start, *(start + span * i // (_PLACES + 1) for i in range(1, _PLACES + 1)), start + span}
                ):
                    fh.seek(offset)
                    digest.update(fh.read(_BLOCK))
        except FileNotFoundError:
            raise SafetensorsIOError(f"{path} is missing") from None
    return digest.hexdigest()[:32]
