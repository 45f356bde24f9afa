"""The documents of one source: a `.txt` file whole, a JSONL line or a Parquet or saved-dataset row each."""

import gzip
import io
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import msgspec

from d9d.data.errors import DatasetError
from d9d.data.prepare.sources import refuse_dataset_dict
from d9d.mesh import first_line

__all__ = ["read_documents"]


def read_documents(path: Path, text_key: str) -> Iterator[str]:
    """The documents of one source file, in order (empty ones skipped).

    Raises:
        DatasetError: the source is unreadable, not UTF-8 or lacks `text_key` (naming the file and
            line or row).
    """
    name = path.name
    try:
        if name.endswith(".txt"):
            text = path.read_bytes().decode("utf-8")
            if text:
                yield text
        elif name.endswith(".parquet"):
            yield from _parquet_documents(path, text_key)
        elif path.is_dir():
            yield from _saved_dataset_documents(path, text_key)
        else:
            yield from _jsonl_documents(path, text_key)
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert it to UTF-8"
        ) from None
    except DatasetError:
        raise
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DatasetError(f"{path} cannot be read ({type(exc).__name__}: {exc}); check the file") from None
    except Exception as exc:  # zstandard's, pyarrow's and datasets' own errors for a damaged file
        if type(exc).__module__.split(".")[0] in ("zstandard", "pyarrow", "datasets"):
            raise DatasetError(
                f"{path} cannot be read ({type(exc).__name__}: {first_line(exc)}); check the file"
            ) from None
        raise


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    decoder = msgspec.json.Decoder()
    with _open_text(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise DatasetError(
                    f"{path}:{number}: not a JSON object ({exc}); fix or remove the line"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path}:{number}: a {type(row).__name__}, not a JSON object; fix the line"
                )
            if text_key not in row:
                keys = ", ".join(sorted(row)[:8]) or "none"
                raise DatasetError(
                    f"{path}:{number}: no {text_key!r} key (its keys: {keys}); pass --text-key with the "
                    "key that holds the text"
                )
            text = row[text_key]
            if not isinstance(text, str):
                raise DatasetError(
                    f"{path}:{number}: {text_key!r} is a {type(text).__name__}, not a string; fix the line"
                )
            if text:
                yield text


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="strict")
    if path.name.endswith(".zst"):
        try:
            import zstandard  # type: ignore[import-not-found]
        except ImportError:
            raise DatasetError(
                f"{path} is zstandard-compressed, which needs the zstandard package: uv pip install zstandard "
                "(or decompress it first)"
            ) from None
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb")), encoding="utf-8")
    return path.open("r", encoding="utf-8", errors="strict", newline="\n")


def _saved_dataset_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise DatasetError(
            f"{path} is a saved Hugging Face dataset, which needs the datasets library (d9d-data's "
            "`hf-datasets` extra): uv sync --all-packages --inexact --extra hf-datasets"
        ) from None
    datasets.disable_progress_bars()
    try:
        table = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises its own errors for a damaged folder
        raise DatasetError(
            f"{path} is not a readable saved dataset ({first_line(exc)}); check the folder"
        ) from None
    if not isinstance(table, datasets.Dataset):
        refuse_dataset_dict(path)
    _check_column(path, text_key, table.column_names)
    batches = table.select_columns([text_key]).iter(batch_size=4096)
    yield from _column_texts(path, text_key, (value for batch in batches for value in batch[text_key]))


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found]
    except ImportError:
        raise DatasetError(
            f"{path} is a Parquet file, which needs pyarrow (d9d-data's `parquet` extra): "
            "uv sync --all-packages --inexact --extra parquet"
        ) from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid for a damaged file
        raise DatasetError(f"{path} is not a readable Parquet file ({exc}); check the file") from None
    _check_column(path, text_key, table.schema_arrow.names)
    batches = table.iter_batches(columns=[text_key], batch_size=4096)
    yield from _column_texts(
        path, text_key, (value for batch in batches for value in batch.column(0).to_pylist())
    )


def _check_column(path: Path, text_key: str, columns: list[str]) -> None:
    if text_key not in columns:
        raise DatasetError(
            f"{path}: no {text_key!r} column (its columns: {', '.join(columns[:8])}); pass --text-key with the "
            "column that holds the text"
        )


def _column_texts(path: Path, text_key: str, values: Iterable[object]) -> Iterator[str]:
    """The non-empty texts of a table's text column, refusing a row that holds no string."""
    for row, value in enumerate(values):
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            raise DatasetError(f"{path}: row {row}: {text_key!r} is {kind}, not a string; fix the row")
        if value:
            yield value
