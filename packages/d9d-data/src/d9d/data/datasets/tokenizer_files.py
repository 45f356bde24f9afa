"""A tokenizer's files: which files make a Hugging Face tokenizer folder, their digest, and copying
them. A prepared folder, a run directory and an export each keep a copy, so that none of them depends
on where the tokenizer was when it was made (the built-in byte tokenizer has no files: nothing to keep)."""

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = [
    "TOKENIZER_FILES",
    "DeclaresTokenizerFiles",
    "copy_tokenizer_files",
    "tokenizer_digest",
    "tokenizer_files",
    "tokenizer_files_at",
]

#: The vocabulary file: a folder is a tokenizer when it holds it.
VOCABULARY = "tokenizer.json"
#: The files of a tokenizer folder, as transformers' `AutoTokenizer.from_pretrained` reads them: the
#: vocabulary, then its special tokens and chat template.
TOKENIZER_FILES = (VOCABULARY, "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@runtime_checkable
class DeclaresTokenizerFiles(Protocol):
    """A tokenizer made from files (a Hugging Face tokenizer folder) that names them."""

    @property
    def files(self) -> dict[str, Path]:
        """{name in `TOKENIZER_FILES`: where that file is}; tokenizer.json is always one of them."""
        ...


def tokenizer_files_at(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The tokenizer files of a folder, or of a tokenizer.json file and the folder it is in (that file
    under the name tokenizer.json, whatever its own); empty when there is no tokenizer.json."""
    file = Path(path)
    if file.is_dir():
        file = file / VOCABULARY
    if not file.is_file():
        return {}
    beside = {name: file.parent / name for name in TOKENIZER_FILES if name != VOCABULARY}
    return {VOCABULARY: file, **{name: p for name, p in beside.items() if p.is_file()}}


def tokenizer_files(tokenizer: object) -> dict[str, Path]:
    """The files of `tokenizer` (a `DeclaresTokenizerFiles`); empty for one without files (byte-level)."""
    return dict(tokenizer.files) if isinstance(tokenizer, DeclaresTokenizerFiles) else {}


def tokenizer_digest(files: Mapping[str, Path]) -> str:
    """sha256 of the files by name (a retrained tokenizer at the same path differs); "" for no files."""
    if not files:
        return ""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if name in files:
            digest.update(name.encode() + b"\0" + Path(files[name]).read_bytes())
    return digest.hexdigest()


def copy_tokenizer_files(files: Mapping[str, Path], folder: str | os.PathLike[str]) -> list[str]:
    """Make `folder`'s tokenizer files exactly `files` (created if needed; other files are kept); the names.

    Each file is written whole (under a temporary name, flushed to disk, renamed) and tokenizer.json
    goes first and comes back last: a copy stopped midway has no tokenizer.json, so it never loads
    as a tokenizer with some of its settings missing. A tokenizer file that `files` lacks (e.g. an
    earlier tokenizer's chat_template.jinja, which would win over the config's template) is removed.
    """
    data = {name: Path(files[name]).read_bytes() for name in TOKENIZER_FILES if name in files}
    target = Path(folder)  # read before anything is removed: `files` may be this folder's own
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name == VOCABULARY or name not in data:
            (target / name).unlink(missing_ok=True)
    for name in sorted(data, key=lambda n: n == VOCABULARY):
        _write_whole(target / name, data[name])
    return sorted(data)


def _write_whole(path: Path, data: bytes) -> None:
    """`data` in `path`, which is whole or absent whenever the writer stops."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
