"""Prepare a corpus once for training: documents from text, JSONL and Parquet files, tokenized in
parallel into memory-mappable token shards plus one index (`prepare_dataset`, `d9d data prepare`).

Every source file becomes one shard, `shard-<i>.bin` (i: the file's position in the sorted source
list), holding the token ids of its documents, each followed by the end-of-document token. A `.txt`
file is one document; a `.jsonl` line (also `.jsonl.gz`, and `.jsonl.zst` with the `zstandard`
package) and a Parquet row are one document each, their text under `text_key`. A shard depends on its
source alone, so the output is the same bytes whatever the number of workers.

Crash safety: a shard is written under a temporary name and renamed when complete, and recorded in
`.prepare/` when its worker returns; `index.json`, which `PreparedDataset` needs, is written (also by
rename) only when every shard is done. A prepare that is killed and started again with the same
arguments keeps the shards it finished (same source size, tokenizer and text key) and does the rest.
"""

import concurrent.futures
import errno
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np

from d9d.data.datasets.packed import token_dtype
from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError
from d9d.mesh import first_line

__all__ = [
    "INDEX_FILE",
    "SOURCE_SUFFIXES",
    "PreparedIndex",
    "PreparedShard",
    "prepare_dataset",
    "read_index",
]

#: The index of a prepared folder: what `PreparedDataset` reads first.
INDEX_FILE = "index.json"
#: The file names `prepare_dataset` reads (a folder is searched for them, recursively).
SOURCE_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
_STATE_DIR = ".prepare"
_FORMAT = 1


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
    """`index.json` of a prepared folder: the shards in order and how they were made."""

    format: int
    dtype: str
    tokenizer: str
    vocab_size: int
    eos_id: int
    text_key: str
    shards: list[PreparedShard]
    tokenizer_sha256: str = ""

    @property
    def documents(self) -> int:
        """Documents in the folder."""
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        """Token ids in the folder."""
        return sum(s.tokens for s in self.shards)


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
            f"{folder} holds no {INDEX_FILE}{unfinished if (folder / _STATE_DIR).is_dir() else ''}; "
            "create the folder with d9d data prepare"
        )
    try:
        index = msgspec.json.decode(path.read_bytes(), type=PreparedIndex)
    except msgspec.DecodeError as exc:
        raise DatasetError(
            f"{path} is not a prepared-dataset index ({exc}); prepare the folder again"
        ) from None
    if index.format != _FORMAT:
        raise DatasetError(f"{path} has format {index.format}, this d9d reads {_FORMAT}; prepare it again")
    return index


def prepare_dataset(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
    text_key: str = "text",
    workers: int = 1,
    dtype: str | None = None,
    progress: bool = True,
    stream: IO[str] | None = None,
) -> PreparedIndex:
    """Tokenize `sources` into the prepared folder `out` (see the module docstring) and return its index.

    Args:
        sources: files or folders (searched recursively for `SOURCE_SUFFIXES`), or a list of them.
        out: the folder to write; it may hold a finished or an interrupted prepare of the same sources.
        tokenizer: None for the built-in byte-level tokenizer, a tokenizer folder or tokenizer.json
            path (needs the `chat` extra's `tokenizers`), or a `Tokenizer` (then `workers` must be 1
            unless it can be pickled).
        text_key: the field of a JSONL object or the Parquet column that holds a document's text.
        workers: processes tokenizing shards at once.
        dtype: "uint16" or "uint32"; by default the smallest that holds the vocabulary.
        progress: show a progress line (bytes read, tokens/s, time left) on `stream` (default
            stderr) while it runs, and a summary line at the end.

    Raises:
        DatasetError: a source is missing, unreadable, empty, not UTF-8 or lacks `text_key` (naming
            the file and line or row); `out` holds a prepare of other sources or another tokenizer.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DatasetError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(text_key, str) or not text_key:
        raise DatasetError(f"text_key must be a non-empty string, got {text_key!r}")
    files = find_sources(sources)
    tok = resolve_tokenizer(tokenizer)
    if tok.eos_id is None:
        raise DatasetError(
            f"the tokenizer {tok.name} has no end-of-document token, which a prepared dataset puts after "
            "every document; use a tokenizer with an eos_token (tokenizer_config.json)"
        )
    np_dtype = token_dtype(dtype, tok.vocab_size)
    out = Path(out)
    jobs = [
        _Job(i, str(path), _size(path), _mtime_ns(path), f"shard-{i:05d}.bin", text_key, np_dtype.name)
        for i, path in enumerate(files)
    ]
    fingerprint = _tokenizer_sha256(tokenizer)
    settings: dict[str, Any] = {"dtype": np_dtype.name, "tokenizer": tok.name, "text_key": text_key,
                                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer_sha256": fingerprint}  # fmt: skip
    finished = _existing_index(out, jobs, settings)
    if finished is not None:
        _summary(stream, progress, finished, 0.0, reused=len(finished.shards))
        return finished
    state = out / _STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(out)
    done = _finished_shards(out, state, jobs, settings)
    pending = [job for job in jobs if job.index not in done]
    bar = _Progress(sum(j.source_bytes for j in jobs), stream or sys.stderr, enabled=progress)
    bar.advance(
        sum(j.source_bytes for j in jobs if j.index in done),
        sum(s.tokens for s in done.values()),
        fresh=False,
    )
    start = time.monotonic()
    try:
        for job, shard in _run(pending, tok, tokenizer, workers, out):
            done[job.index] = shard
            record = {**settings, **msgspec.to_builtins(shard)}
            _atomic_write(state / f"{job.file}.json", json.dumps(record).encode())
            bar.advance(job.source_bytes, shard.tokens)
    finally:
        bar.close()
    index = PreparedIndex(
        format=_FORMAT,
        dtype=np_dtype.name,
        tokenizer=tok.name,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        text_key=text_key,
        shards=[done[job.index] for job in jobs],
        tokenizer_sha256=fingerprint,
    )
    _atomic_write(out / INDEX_FILE, msgspec.json.format(msgspec.json.encode(index)))
    shutil.rmtree(state, ignore_errors=True)
    _summary(stream, progress, index, time.monotonic() - start, reused=len(jobs) - len(pending))
    return index


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
        if path.is_dir() and _is_saved_dataset(path):
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


# ---------------------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class _Job:
    index: int
    source: str
    source_bytes: int
    source_mtime_ns: int
    file: str
    text_key: str
    dtype: str


def _run(
    jobs: list[_Job], tok: Tokenizer, spec: Any, workers: int, out: Path
) -> Iterator[tuple[_Job, PreparedShard]]:
    """Tokenize `jobs` (in this process for one worker), yielding each as it completes."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield job, _tokenize_shard(job, tok, out)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=min(workers, len(jobs)), mp_context=context, initializer=_init_worker, initargs=(spec,)
    )
    futures = {pool.submit(_worker_shard, job, str(out)): job for job in jobs}
    try:
        for future in concurrent.futures.as_completed(futures):
            try:
                shard = future.result()
            except BaseException:
                # Hand over every other shard that finished (so a rerun keeps it), then stop at once.
                for other, job in futures.items():
                    if (
                        other is not future
                        and other.done()
                        and not other.cancelled()
                        and other.exception() is None
                    ):
                        yield job, other.result()
                raise
            yield futures[future], shard
    finally:
        # Stop the workers still tokenizing (their temporaries are removed by the next prepare), then
        # let the pool's manager thread, which also waits on them, finish before returning.
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(5)
            if process.is_alive():  # a worker that does not take SIGTERM is not left behind
                process.kill()
                process.join()
        pool.shutdown(wait=True, cancel_futures=True)


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: Any) -> None:
    global _WORKER_TOKENIZER
    # A forked worker inherits the parent's handlers; a trainer's graceful-stop SIGTERM handler would
    # keep it alive when the prepare stops it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # each worker tokenizes on one thread
    _WORKER_TOKENIZER = resolve_tokenizer(spec)


def _worker_shard(job: _Job, out: str) -> PreparedShard:
    assert _WORKER_TOKENIZER is not None
    return _tokenize_shard(job, _WORKER_TOKENIZER, Path(out))


def _tokenize_shard(job: _Job, tok: Tokenizer, out: Path) -> PreparedShard:
    """Write `job`'s shard (temporary name, renamed when complete) and describe it."""
    dtype = np.dtype(job.dtype)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    final = out / job.file
    tmp = out / f".{job.file}.tmp-{os.getpid()}"
    documents = tokens = 0
    limit = np.iinfo(dtype).max
    try:
        batch_encode = getattr(tok, "encode_batch", None)  # a Hugging Face tokenizer's, many documents a call
        with tmp.open("wb") as handle:
            for texts in _batches(_documents(Path(job.source), job.text_key)):
                encoded = batch_encode(texts) if batch_encode is not None else [tok.encode(t) for t in texts]
                for ids in encoded:
                    ids = np.asarray(ids, dtype=np.int64)
                    if ids.size and (int(ids.max()) > limit or int(ids.min()) < 0):
                        raise DatasetError(
                            f"{job.source}: a token id does not fit {job.dtype}; pass dtype='uint32'"
                        )
                    handle.write(ids.astype(dtype).data)  # not tofile: its short write has no errno
                    handle.write(eos.data)
                    documents += 1
                    tokens += ids.size + 1
            handle.flush()
            os.fsync(handle.fileno())  # on disk before it is renamed into place
        if documents == 0:
            raise DatasetError(f"{job.source} holds no documents; remove it from the sources or add text")
        tmp.replace(final)
    except OSError as exc:
        raise _no_room(exc, final) from None
    finally:
        tmp.unlink(missing_ok=True)
    return PreparedShard(
        file=job.file,
        source=job.source,
        source_bytes=job.source_bytes,
        documents=documents,
        tokens=tokens,
        source_mtime_ns=job.source_mtime_ns,
    )


def _batches(documents: Iterator[str], *, count: int = 256, chars: int = 1 << 22) -> Iterator[list[str]]:
    """`documents` in lists of up to `count` documents or about `chars` characters, in order."""
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if len(batch) >= count or size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _documents(path: Path, text_key: str) -> Iterator[str]:
    """The documents of one source file, in order."""
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
        _refuse_dataset_dict(path)
    if text_key not in table.column_names:
        raise DatasetError(
            f"{path}: no {text_key!r} column (its columns: {', '.join(table.column_names[:8])}); pass --text-key "
            "with the column that holds the text"
        )
    row = 0
    for batch in table.select_columns([text_key]).iter(batch_size=4096):
        for value in batch[text_key]:
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                raise DatasetError(f"{path}: row {row}: {text_key!r} is {kind}, not a string; fix the row")
            row += 1
            if value:
                yield value


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
    columns = table.schema_arrow.names
    if text_key not in columns:
        raise DatasetError(
            f"{path}: no {text_key!r} column (its columns: {', '.join(columns[:8])}); pass --text-key with the "
            "column that holds the text"
        )
    row = 0
    for batch in table.iter_batches(columns=[text_key], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                raise DatasetError(f"{path}: row {row}: {text_key!r} is {kind}, not a string; fix the row")
            row += 1
            if value:
                yield value


# ---------------------------------------------------------------------------------------- resume


def _existing_index(out: Path, jobs: list[_Job], settings: dict[str, str]) -> PreparedIndex | None:
    """The folder's index when it is a finished prepare of exactly these jobs, None when there is none.

    Raises:
        DatasetError: it is a prepare of other sources or settings.
    """
    if not (out / INDEX_FILE).is_file():
        return None
    index = read_index(out)
    have = [(s.source, s.source_bytes, s.source_mtime_ns) for s in index.shards]
    want = [(j.source, j.source_bytes, j.source_mtime_ns) for j in jobs]
    mine = {"dtype": index.dtype, "tokenizer": index.tokenizer, "text_key": index.text_key,
            "vocab_size": index.vocab_size, "eos_id": index.eos_id, "tokenizer_sha256": index.tokenizer_sha256}  # fmt: skip
    if have != want or mine != settings:
        changed = sorted(k for k in settings if mine.get(k) != settings[k])
        if changed:
            what = f"other settings ({', '.join(changed)})"
        elif [h[0] for h in have] != [w[0] for w in want]:
            what = f"other sources ({len(have)} of them)"
        else:
            edited = next(w[0] for h, w in zip(have, want, strict=True) if h != w)
            what = f"sources that changed since (e.g. {edited})"
        raise DatasetError(
            f"{out} already holds a prepared dataset of {what}; prepare into another --out folder, or "
            "delete that one"
        )
    for shard in index.shards:
        _check_shard_size(out, shard, index.dtype)
    return index


def _finished_shards(
    out: Path, state: Path, jobs: list[_Job], settings: dict[str, str]
) -> dict[int, PreparedShard]:
    """Shards an interrupted prepare finished that still match their job (same source size and settings)."""
    done: dict[int, PreparedShard] = {}
    for job in jobs:
        record_path = state / f"{job.file}.json"
        if not record_path.is_file() or not (out / job.file).is_file():
            continue
        try:
            record = json.loads(record_path.read_bytes())
            keys = ("file", "source", "source_bytes", "documents", "tokens", "source_mtime_ns")
            shard = PreparedShard(**{k: record[k] for k in keys})
        except (ValueError, KeyError, TypeError):
            continue  # a record from another version: redo the shard
        same = all(record.get(k) == v for k, v in settings.items())
        whole = (out / job.file).stat().st_size == shard.tokens * np.dtype(job.dtype).itemsize
        identity = (shard.source, shard.source_bytes, shard.source_mtime_ns)
        if same and whole and identity == (job.source, job.source_bytes, job.source_mtime_ns):
            done[job.index] = shard
    return done


def _check_shard_size(out: Path, shard: PreparedShard, dtype: str) -> None:
    path = out / shard.file
    expected = shard.tokens * np.dtype(dtype).itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise DatasetError(
            f"{path} is {found}, the index says {expected} bytes ({shard.tokens} tokens); the folder is "
            "damaged: prepare it again into an empty folder"
        )


def _remove_temporaries(out: Path) -> None:
    for tmp in out.glob(".shard-*.tmp-*"):
        tmp.unlink(missing_ok=True)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        raise _no_room(exc, path) from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


#: Write errors of a full disk, a full quota and a file size limit.
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _no_room(exc: OSError, path: Path) -> OSError | DatasetError:
    """A full disk (or quota, or file size limit) as one line; any other write error as it was."""
    if exc.errno not in _DISK_FULL:
        return exc
    return DatasetError(
        f"no room to write {path} ({os.strerror(exc.errno)}): free space under {path.parent} (or raise the "
        "quota or file size limit) and run the same command again; the shards finished so far are kept"
    )


def _fsync_dir(folder: Path) -> None:
    """Make the renames into `folder` durable (a crash may otherwise keep the new index, not the shards)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_source(path: Path) -> bool:
    return path.name.endswith(SOURCE_SUFFIXES)


def _is_saved_dataset(path: Path) -> bool:
    """A folder `datasets.Dataset.save_to_disk` wrote (one split)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _sources_in(root: Path) -> list[Path]:
    """The source files and saved-dataset folders under `root` (not inside a saved dataset), sorted."""
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if here != root and _is_saved_dataset(here):
            found.append(here)
            dirs[:] = []
            continue
        if (here / "dataset_dict.json").is_file():
            _refuse_dataset_dict(here)
        found.extend(here / n for n in names if not n.startswith(".") and _is_source(here / n))
    return sorted(found)


def _refuse_dataset_dict(path: Path) -> None:
    splits = sorted(p.name for p in path.iterdir() if p.is_dir() and _is_saved_dataset(p))
    raise DatasetError(
        f"{path} is a saved DatasetDict of splits {', '.join(splits) or '(none)'}; name the folder of the split "
        f"to prepare, e.g. {path / (splits[0] if splits else 'train')}"
    )


def _mtime_ns(path: Path) -> int:
    if path.is_dir():
        return max((p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()), default=0)
    return path.stat().st_mtime_ns


def _tokenizer_sha256(spec: Any) -> str:
    """A digest of a tokenizer folder's files (a retrained tokenizer at the same path differs); the
    built-in byte tokenizer and tokenizer objects are named by `Tokenizer.name` alone."""
    if not isinstance(spec, str | os.PathLike):
        return ""
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        file = folder / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file())
    return path.stat().st_size


def _suffixes() -> str:
    return "/".join(SOURCE_SUFFIXES)


# ---------------------------------------------------------------------------------------- progress


class _Progress:
    """A progress line on a terminal (source bytes read, tokens/s, time left)."""

    def __init__(self, total_bytes: int, stream: IO[str], *, enabled: bool) -> None:
        self._total = max(total_bytes, 1)
        self._stream = stream
        self._tty = enabled and stream.isatty()
        self._bytes = self._tokens = 0
        self._start = time.monotonic()
        self._fresh_bytes = self._fresh_tokens = 0  # this run's work, for the rate
        self._shown = False

    def advance(self, nbytes: int, ntokens: int, *, fresh: bool = True) -> None:
        self._bytes += nbytes
        self._tokens += ntokens
        if fresh:
            self._fresh_bytes += nbytes
            self._fresh_tokens += ntokens
        if self._tty:
            elapsed = max(time.monotonic() - self._start, 1e-9)
            rate = self._fresh_bytes / elapsed
            left = (self._total - self._bytes) / rate if rate > 0 else float("nan")
            fraction = min(self._bytes / self._total, 1.0)
            filled = int(fraction * 30)
            eta = f"{left:5.0f}s" if left == left else "    ?"
            self._stream.write(
                f"\rpreparing [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%}  {self._tokens:,} tokens  "
                f"{self._fresh_tokens / elapsed:,.0f} tokens/s  eta {eta} "
            )
            self._stream.flush()
            self._shown = True

    def close(self) -> None:
        if self._tty and self._shown:
            self._stream.write("\n")
            self._stream.flush()


def _summary(
    stream: IO[str] | None, enabled: bool, index: PreparedIndex, seconds: float, *, reused: int
) -> None:
    if not enabled:
        return
    stream = stream or sys.stderr
    kept = f", {reused} of them kept from before" if reused else ""
    rate = f" in {seconds:.1f} s ({index.tokens / max(seconds, 1e-9):,.0f} tokens/s)" if seconds > 0 else ""
    docs, shards = index.documents, len(index.shards)
    stream.write(
        f"prepared {docs:,} document{'s' * (docs != 1)}, {index.tokens:,} tokens ({index.dtype}, tokenizer "
        f"{index.tokenizer}) in {shards} shard{'s' * (shards != 1)}{kept}{rate}\n"
    )
    stream.flush()
