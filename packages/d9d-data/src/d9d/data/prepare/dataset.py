"""`prepare_dataset`: one prepare, phase by phase: check the arguments, plan a shard per source, keep
what an earlier prepare of the same sources finished, tokenize the rest, then commit the index."""

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import msgspec

from d9d.data.datasets.packed import token_dtype
from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer
from d9d.data.datasets.tokenizer_files import copy_tokenizer_files, tokenizer_digest, tokenizer_files
from d9d.data.errors import DatasetError
from d9d.data.prepare.index import FORMAT, TOKENIZER_DIR, PreparedIndex, PreparedShard
from d9d.data.prepare.pool import run_jobs
from d9d.data.prepare.progress import Progress, summary
from d9d.data.prepare.sources import find_sources
from d9d.data.prepare.writer import ShardJob, commit_index, existing_index, plan_jobs, record_shard, resume

__all__ = ["prepare_dataset"]


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
    """Tokenize `sources` into the prepared folder `out` (see `d9d.data.prepare`) and return its index.

    Args:
        sources: files or folders (searched recursively for `SOURCE_SUFFIXES`), or a list of them.
        out: the folder to write; it may hold a finished or an interrupted prepare of the same sources.
        tokenizer: None for the built-in byte-level tokenizer, a tokenizer folder or tokenizer.json
            path (needs the `chat` extra's `tokenizers`), or a `Tokenizer` (then `workers` must be 1
            unless it can be pickled). The files of a tokenizer folder are copied into `out`
            (`TOKENIZER_DIR`), so the folder trains and generates wherever it is used from.
        text_key: the field of a JSONL object or the Parquet column that holds a document's text.
        workers: processes tokenizing shards at once.
        dtype: "uint16" or "uint32"; by default the smallest that holds the vocabulary.
        progress: show a progress line (bytes read, tokens/s, time left) on `stream` (default
            stderr) while it runs, and a summary line at the end.

    Raises:
        DatasetError: a source is missing, unreadable, empty, not UTF-8 or lacks `text_key` (naming
            the file and line or row); `out` holds a prepare of other sources or another tokenizer.
    """
    _check_arguments(workers, text_key)
    files = find_sources(sources)
    tok = _tokenizer_with_eos(tokenizer)
    np_dtype = token_dtype(dtype, tok.vocab_size)
    out = Path(out)
    jobs = plan_jobs(files, text_key, np_dtype.name)
    empty = _empty_index(tok, np_dtype.name, text_key)
    finished = existing_index(out, jobs, empty.settings)
    if finished is not None:
        kept = _copy_tokenizer(out, tok, finished)
        if kept is not finished:  # prepared before d9d kept the copy: it gets one now
            commit_index(out, kept)
        summary(stream, progress, finished, 0.0, reused=len(finished.shards))
        return kept
    done = resume(out, jobs, empty.settings)
    pending = [job for job in jobs if job.index not in done]
    bar = _progress(jobs, done, stream, enabled=progress)
    start = time.monotonic()
    try:
        for job, shard in run_jobs(pending, tok, tokenizer, workers, out):
            done[job.index] = shard
            record_shard(out, job, shard, empty.settings)
            bar.advance(job.source_bytes, shard.tokens)
    finally:
        bar.close()
    index = _copy_tokenizer(
        out, tok, msgspec.structs.replace(empty, shards=[done[job.index] for job in jobs])
    )
    commit_index(out, index)
    summary(stream, progress, index, time.monotonic() - start, reused=len(jobs) - len(pending))
    return index


def _check_arguments(workers: int, text_key: str) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise DatasetError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(text_key, str) or not text_key:
        raise DatasetError(f"text_key must be a non-empty string, got {text_key!r}")


def _tokenizer_with_eos(spec: Tokenizer | str | os.PathLike[str] | None) -> Tokenizer:
    """The tokenizer `spec` names, refused without the end-of-document token every document ends with."""
    tok = resolve_tokenizer(spec)
    if tok.eos_id is None:
        raise DatasetError(
            f"the tokenizer {tok.name} has no end-of-document token, which a prepared dataset puts after "
            "every document; use a tokenizer with an eos_token (tokenizer_config.json)"
        )
    return tok


def _empty_index(tok: Tokenizer, dtype: str, text_key: str) -> PreparedIndex:
    """The index of this prepare before it has shards: its settings, which finished shards must share."""
    assert tok.eos_id is not None  # _tokenizer_with_eos refused a tokenizer without one
    files = tokenizer_files(tok)
    return PreparedIndex(
        format=FORMAT,
        dtype=dtype,
        tokenizer=str(files["tokenizer.json"].absolute()) if files else tok.name,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        text_key=text_key,
        shards=[],
        tokenizer_sha256=tokenizer_digest(files),
    )


def _copy_tokenizer(out: Path, tok: Tokenizer, index: PreparedIndex) -> PreparedIndex:
    """Copy the tokenizer's files into the folder (`TOKENIZER_DIR`), so that it does not depend on where
    they were, and return the index that names the copy; `index` itself for a tokenizer without files
    (byte-level) or an index that names a copy already."""
    files = tokenizer_files(tok)
    if not files or index.tokenizer_folder:
        return index
    copy_tokenizer_files(files, out / TOKENIZER_DIR)
    return msgspec.structs.replace(index, tokenizer_folder=TOKENIZER_DIR)


def _progress(
    jobs: list[ShardJob], done: dict[int, PreparedShard], stream: IO[str] | None, *, enabled: bool
) -> Progress:
    """A progress line over all sources that starts with the shards kept from before."""
    bar = Progress(sum(j.source_bytes for j in jobs), stream or sys.stderr, enabled=enabled)
    bar.advance(
        sum(j.source_bytes for j in jobs if j.index in done),
        sum(s.tokens for s in done.values()),
        fresh=False,
    )
    return bar
