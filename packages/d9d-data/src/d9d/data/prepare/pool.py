"""Tokenizes shards: in this process for one worker, else in a pool of worker processes that each load
the tokenizer once; a shard depends on its source alone, so the bytes do not depend on the workers."""

import concurrent.futures
import multiprocessing
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from d9d.data.datasets.tokenizer import Tokenizer, resolve_tokenizer
from d9d.data.errors import DatasetError
from d9d.data.prepare.documents import read_documents
from d9d.data.prepare.index import PreparedShard
from d9d.data.prepare.writer import ShardJob, remove_temporaries, write_atomic

__all__ = ["run_jobs", "tokenize_shard"]


def run_jobs(
    jobs: list[ShardJob], tok: Tokenizer, spec: Any, workers: int, out: Path
) -> Iterator[tuple[ShardJob, PreparedShard]]:
    """Tokenize `jobs` (in this process for one worker), yielding each as it completes.

    Args:
        spec: what `tok` was resolved from, for the workers to resolve again.
    """
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield job, tokenize_shard(job, tok, out)
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
        _stop(pool)
        remove_temporaries(out)  # what the stopped workers left half-written


def _stop(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stop the workers still tokenizing, then let the pool's manager thread, which also waits on them,
    finish before returning."""
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


def _worker_shard(job: ShardJob, out: str) -> PreparedShard:
    assert _WORKER_TOKENIZER is not None
    return tokenize_shard(job, _WORKER_TOKENIZER, Path(out))


@dataclass
class _Counts:
    documents: int = 0
    tokens: int = 0


def tokenize_shard(job: ShardJob, tok: Tokenizer, out: Path) -> PreparedShard:
    """Write `job`'s shard (temporary name, renamed when complete) and describe it."""
    counts = _Counts()
    write_atomic(out / job.file, _encoded(job, tok, counts))
    return PreparedShard(
        file=job.file,
        source=job.source,
        source_bytes=job.source_bytes,
        documents=counts.documents,
        tokens=counts.tokens,
        source_mtime_ns=job.source_mtime_ns,
    )


def _encoded(job: ShardJob, tok: Tokenizer, counts: _Counts) -> Iterator[memoryview]:
    """The token ids of `job`'s documents as bytes, each document followed by the end-of-document token.

    Raises:
        DatasetError: a token id does not fit the shard's dtype, or the source holds no document.
    """
    dtype = np.dtype(job.dtype)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    limit = np.iinfo(dtype).max
    batch_encode = getattr(tok, "encode_batch", None)  # a Hugging Face tokenizer's, many documents a call
    for texts in _batches(read_documents(Path(job.source), job.text_key)):
        encoded = batch_encode(texts) if batch_encode is not None else [tok.encode(t) for t in texts]
        for ids in encoded:
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (int(ids.max()) > limit or int(ids.min()) < 0):
                raise DatasetError(f"{job.source}: a token id does not fit {job.dtype}; pass dtype='uint32'")
            yield ids.astype(dtype).data
            yield eos.data
            counts.documents += 1
            counts.tokens += ids.size + 1
    if counts.documents == 0:
        raise DatasetError(f"{job.source} holds no documents; remove it from the sources or add text")


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
