"""The index of a prepared folder (`index.json`): its shards in order and what they were made with."""

import os
from pathlib import Path
from typing import Any

import msgspec

from d9d.data.errors import DatasetError

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "STATE_DIR",
    "TOKENIZER_DIR",
    "PreparedIndex",
    "PreparedShard",
    "read_index",
]

#: The index of a prepared folder: what `PreparedDataset` reads first.
INDEX_FILE = "index.json"
#: The folder of an unfinished prepare (a record per finished shard); removed once the index is written.
STATE_DIR = ".prepare"
#: The folder of the copy of the tokenizer files a prepared folder keeps (none for the byte tokenizer).
TOKENIZER_DIR = "tokenizer"
#: The index format this d9d writes and reads. Fields added since have defaults (`tokenizer_folder`),
#: so folders prepared before them read as they are, and an older d9d reads newer folders.
FORMAT = 1


class PreparedShard(msgspec.Struct, frozen=True, kw_only=True):
    """One token shard of a prepared folder.

    Attributes:
        file: the shard's file name in the folder.
        source: the source file it was tokenized from, as it was named to the prepare.
        source_bytes: the source file's size when it was read.
        source_mtime_ns: its modification time then (a source changed in place is prepared again).
        documents: documents in it (each ends with the end-of-document token).
        tokens: token ids in it.
    """

    file: str
    source: str
    source_bytes: int
    documents: int
    tokens: int
    source_mtime_ns: int = 0


class PreparedIndex(msgspec.Struct, frozen=True, kw_only=True):
    """`index.json` of a prepared folder: the shards in order and how they were made.

    Attributes:
        tokenizer: "byte", or where the tokenizer was (its tokenizer.json; an absolute path since the
            folder keeps a copy, else as the prepare was given it).
        tokenizer_sha256: the digest of its files (`d9d.data.tokenizer_digest`); "" for the byte tokenizer.
        tokenizer_folder: the folder (in this one) holding the copy of the tokenizer's files; "" when
            it has none (the byte tokenizer, or a folder prepared before d9d kept the copy).
    """

    format: int
    dtype: str
    tokenizer: str
    vocab_size: int
    eos_id: int
    text_key: str
    shards: list[PreparedShard]
    tokenizer_sha256: str = ""
    tokenizer_folder: str = ""

    @property
    def documents(self) -> int:
        """Documents in the folder."""
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        """Token ids in the folder."""
        return sum(s.tokens for s in self.shards)

    @property
    def tokenizer_identity(self) -> str:
        """What tells tokenizers apart: the digest of its files, else (the byte tokenizer) its name."""
        return self.tokenizer_sha256 or self.tokenizer

    @property
    def settings(self) -> dict[str, Any]:
        """What every shard was made with: a prepare with other settings cannot keep them."""
        return {"dtype": self.dtype, "tokenizer": self.tokenizer_identity, "text_key": self.text_key,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id}  # fmt: skip


def read_index(folder: str | os.PathLike[str]) -> PreparedIndex:
    """The index of a prepared folder.

    Raises:
        DatasetError: there is no folder, no index (the prepare did not finish) or a malformed one.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"no prepared dataset folder at {folder}; create it with d9d data prepare")
    path = folder / INDEX_FILE
    if not path.is_file():
        unfinished = " (a prepare started there did not finish: run it again to complete it)"
        raise DatasetError(
            f"{folder} holds no {INDEX_FILE}{unfinished if (folder / STATE_DIR).is_dir() else ''}; "
            "create the folder with d9d data prepare"
        )
    try:
        index = msgspec.json.decode(path.read_bytes(), type=PreparedIndex)
    except msgspec.DecodeError as exc:
        raise DatasetError(
            f"{path} is not a prepared-dataset index ({exc}); prepare the folder again"
        ) from None
    if index.format != FORMAT:
        raise DatasetError(f"{path} has format {index.format}, this d9d reads {FORMAT}; prepare it again")
    return index
