"""Which files a prepare reads: sources named as files or found in folders, and their size and age."""

import os
from collections.abc import Sequence
from pathlib import Path

from d9d.data.errors import DatasetError

__all__ = [
    "SOURCE_SUFFIXES",
    "find_sources",
    "is_saved_dataset",
    "refuse_dataset_dict",
    "source_bytes",
    "source_mtime_ns",
]

#: The file names `prepare_dataset` reads (a folder is searched for them, recursively).
SOURCE_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def find_sources(sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The source files named by `sources`: files as given, folders expanded to their files with a
    `SOURCE_SUFFIXES` name and to the saved Hugging Face datasets in them (recursively, sorted,
    hidden entries skipped); the list in that order.

    Raises:
        DatasetError: a path does not exist, a file has another suffix, a folder holds no source, a
            saved DatasetDict is named instead of one of its splits.
    """
    items = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    if not items:
        raise DatasetError("no sources were given; pass files or folders of " + _suffixes())
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir() and is_saved_dataset(path):
            files.append(path)
        elif path.is_dir():
            found = _sources_in(path)
            if not found:
                raise DatasetError(f"the folder {path} holds no {_suffixes()} files; name another folder")
            files.extend(found)
        elif path.is_file():
            if not _is_source(path):
                raise DatasetError(f"{path} is not a source d9d reads; use {_suffixes()} files")
            files.append(path)
        else:
            raise DatasetError(f"no source file or folder at {path}; check the path")
    seen: set[Path] = set()
    unique = []
    for file in files:  # a file named twice (e.g. a folder and a file in it) is prepared once
        key = file.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(file)
    return unique


def is_saved_dataset(path: Path) -> bool:
    """A folder `datasets.Dataset.save_to_disk` wrote (one split)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def refuse_dataset_dict(path: Path) -> None:
    """Refuse a saved DatasetDict, naming its splits: a prepare reads one split."""
    splits = sorted(p.name for p in path.iterdir() if p.is_dir() and is_saved_dataset(p))
    raise DatasetError(
        f"{path} is a saved DatasetDict of splits {', '.join(splits) or '(none)'}; name the folder of the split "
        f"to prepare, e.g. {path / (splits[0] if splits else 'train')}"
    )


def source_bytes(path: Path) -> int:
    """The size of a source file, or of all files of a saved dataset."""
    if path.is_dir():
        return sum(p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file())
    return path.stat().st_size


def source_mtime_ns(path: Path) -> int:
    """When a source file, or the newest file of a saved dataset, was last changed."""
    if path.is_dir():
        return max((p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()), default=0)
    return path.stat().st_mtime_ns


def _is_source(path: Path) -> bool:
    return path.name.endswith(SOURCE_SUFFIXES)


def _sources_in(root: Path) -> list[Path]:
    """The source files and saved-dataset folders under `root` (not inside a saved dataset), sorted."""
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if here != root and is_saved_dataset(here):
            found.append(here)
            dirs[:] = []
            continue
        if (here / "dataset_dict.json").is_file():
            refuse_dataset_dict(here)
        found.extend(here / n for n in names if not n.startswith(".") and _is_source(here / n))
    return sorted(found)


def _suffixes() -> str:
    return "/".join(SOURCE_SUFFIXES)
