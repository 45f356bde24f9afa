"""Throughput of `d9d data prepare` (`d9d.data.prepare_dataset`) against the ways people tokenize a
corpus without it, and of the mixture loader against what a GPU consumes.

    uv run python benchmarks/data_prepare.py [--mb 200] [--files 8] [--loader-tokens 1e9] [--json rows.json]

Corpus: `--mb` MB of synthetic text (documents of ~1 KB drawn from 4,000 made-up words with a Zipf
frequency, so a BPE vocabulary has real work), written once as `--files` JSONL files and once as as
many Parquet files (the same documents). Tokenizer: a BPE of 8,000 ids trained on the first file by
the `tokenizers` library, saved as a Hugging Face tokenizer folder. Every way below writes the same
tokens (each document's ids then EOS) as uint16, and each is timed from the source files to the
token files on disk (the median of `--repeats` runs):

- d9d prepare with 1 and with 2 worker processes (`workers=`);
- the single-process reference: read the file, `Tokenizer.encode_batch` of 256 documents at a time,
  `numpy.ndarray.tofile`; once with the tokenizers library's own thread pool (its default) and once
  with `TOKENIZERS_PARALLELISM=false` (one core: the reference the 2-worker goal is stated against);
- Hugging Face `datasets`: `load_dataset(json|parquet)` into a cache in the temp folder,
  `.map(batched=True, num_proc=2)` with the same tokenizer, then the ids flattened and written with
  numpy (each in a fresh process: datasets and the thread pool keep state).

Loader: a synthetic prepared folder of `--loader-tokens` tokens (three sources, 50/30/20% of the
tokens, documents of ~2,000 tokens) read as a `dataset.mixture` with weights 5/3/2 at seq 8,192 with
document masking, through `AutoDataProvider` (one rank, batches of 8 sequences, no loader workers),
in tokens/s against what one rank of a Llama 3 8B run on an H100 consumes (~6,000 tokens/s/GPU at
seq 8,192, torchtitan's published bf16 figure): the margin. The folder is written just before, so
its pages are in the page cache: a cold disk is slower.

Reads: 10,000 random samples of 1,024 tokens from the JSONL corpus's prepared folder (one `pread`
per sample window) vs the same tokens in one memory-mapped token file (`TokenFileDataset`; ideal 1:
shards cost nothing). `--parts` picks what runs (default all three).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
from _common import row, write_rows

from d9d.data import (
    AutoDataConfig,
    AutoDataProvider,
    MixtureDataset,
    PreparedDataset,
    TokenFileDataset,
    prepare_dataset,
)

HERE = Path(__file__).resolve()
H100_8B_TOKENS_PER_S = 6000  # one rank of Llama 3 8B, bf16, seq 8192 (torchtitan's H100 figure)


def _corpus(root: Path, mb: float, files: int) -> tuple[Path, Path, int]:
    """`mb` MB of documents as `files` JSONL files and as many Parquet files; returns both folders."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = np.array(["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(4000)])
    weights = 1 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    jsonl, parquet = root / "jsonl", root / "parquet"
    jsonl.mkdir()
    parquet.mkdir()
    per_file = int(mb * 1e6 / files)
    size = 0
    for f in range(files):
        texts: list[str] = []
        written = 0
        while written < per_file:
            picks = rng.choice(len(words), size=(256, 180), p=weights)
            for doc in picks:
                text = " ".join(words[doc])
                texts.append(text)
                written += len(text)
        with (jsonl / f"part-{f:03d}.jsonl").open("w", encoding="utf-8") as out:
            for text in texts:
                out.write(json.dumps({"text": text}) + "\n")
        pq.write_table(pa.table({"text": texts}), parquet / f"part-{f:03d}.parquet")
        size += written
    return jsonl, parquet, size


def _bpe_folder(first: Path, folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(
        (json.loads(line)["text"] for line in first.open(encoding="utf-8")), trainer
    )
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    return folder


def _texts(path: Path) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh]


def _reference(src: Path, out: Path, tokenizer_dir: Path) -> int:
    """One process: encode_batch of 256 documents at a time, ids + EOS, numpy write per file."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    out.mkdir()
    tokens = 0
    for path in sorted(src.iterdir()):
        texts = _texts(path)
        parts = []
        for i in range(0, len(texts), 256):
            for encoding in tokenizer.encode_batch(texts[i : i + 256], add_special_tokens=False):
                parts.append(np.asarray(encoding.ids, dtype=np.uint16))
                parts.append(np.asarray([eos], dtype=np.uint16))
        ids = np.concatenate(parts)
        ids.tofile(out / f"{path.stem}.bin")
        tokens += ids.size
    return tokens


def _hf_datasets(src: Path, out: Path, tokenizer_dir: Path) -> int:
    """datasets: load into a cache, map(batched=True, num_proc=2), flatten, numpy write."""
    import datasets
    import pyarrow.compute as pc
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    kind = "parquet" if next(src.iterdir()).suffix == ".parquet" else "json"
    files = [str(p) for p in sorted(src.iterdir())]
    loaded = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=str(out / "cache"))
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {
            "ids": [[*e.ids, eos] for e in tokenizer.encode_batch(batch["text"], add_special_tokens=False)]
        }

    mapped = loaded.map(encode, batched=True, num_proc=2, remove_columns=["text"])
    ids = pc.list_flatten(mapped.data.column("ids")).to_numpy().astype(np.uint16)
    ids.tofile(out / "tokens.bin")
    return int(ids.size)


def _timed_child(kind: str, src: Path, out: Path, tokenizer: Path, env: dict[str, str]) -> tuple[float, int]:
    """Run `_reference` or `_hf_datasets` in a fresh process; (seconds, tokens)."""
    result = subprocess.run(
        [sys.executable, str(HERE), "--child", kind, str(src), str(out), str(tokenizer)],
        capture_output=True, text=True, env={**os.environ, **env}, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{result.stderr[-3000:]}")
    seconds, tokens = result.stdout.split()[-2:]
    return float(seconds), int(tokens)


def _median(run: "object", repeats: int, out: Path) -> tuple[float, int]:
    times, tokens = [], 0
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        seconds, tokens = run()  # type: ignore[operator]
        times.append(seconds)
    shutil.rmtree(out, ignore_errors=True)
    return statistics.median(times), tokens


def _prepare(src: Path, out: Path, workers: int, tokenizer: Path) -> tuple[float, int]:
    start = time.perf_counter()
    index = prepare_dataset(src, out, workers=workers, tokenizer=tokenizer, progress=False)
    return time.perf_counter() - start, index.tokens


def _synthetic_prepared(folder: Path, tokens: int, doc_tokens: int = 2000, shard: int = 50_000_000) -> None:
    """A prepared folder of `tokens` random ids (vocab 8,000) with an EOS every ~`doc_tokens`."""
    from d9d.data.prepare.index import INDEX_FILE, PreparedIndex, PreparedShard

    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    shards = []
    for i, start in enumerate(range(0, tokens, shard)):
        n = min(shard, tokens - start)
        ids = rng.integers(2, 8000, n, dtype=np.uint16)
        ids[doc_tokens - 1 :: doc_tokens] = 1  # EOS
        name = f"shard-{i:05d}.bin"
        ids.tofile(folder / name)
        shards.append(
            PreparedShard(
                file=name, source=f"synthetic-{i}", source_bytes=0, documents=n // doc_tokens, tokens=n
            )
        )
    index = PreparedIndex(
        format=1,
        dtype="uint16",
        tokenizer="synthetic",
        vocab_size=8000,
        eos_id=1,
        text_key="text",
        shards=shards,
    )
    (folder / INDEX_FILE).write_bytes(msgspec.json.encode(index))


def _loader(root: Path, total_tokens: int, steps: int) -> tuple[float, int]:
    """Tokens/s of a 3-source mixture at seq 8192 through AutoDataProvider; (tokens/s, tokens read)."""
    parts = []
    for name, share in (("web", 0.5), ("code", 0.3), ("books", 0.2)):
        _synthetic_prepared(root / name, int(total_tokens * share))
        parts.append(PreparedDataset(root / name, 8192, document_masking=True))
    mixture = MixtureDataset(parts, [5, 3, 2], names=["web", "code", "books"])
    provider = AutoDataProvider(AutoDataConfig(global_batch_size=8, microbatch_size=1, seed=0), mixture)
    next(provider)  # the loader's start
    start = time.perf_counter()
    for _ in range(steps):
        next(provider)
    seconds = time.perf_counter() - start
    provider.close()
    return steps * 8 * 8192 / seconds, steps * 8 * 8192


def _read_seconds(dataset: object, picks: np.ndarray) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for i in picks:
            dataset[int(i)]  # type: ignore[index]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reads(src: Path, root: Path, tokenizer: Path) -> tuple[float, float, int]:
    """Seconds for 10,000 random samples: (prepared folder, one token file, shards)."""
    prepare_dataset(src, root / "kept", workers=2, tokenizer=tokenizer, progress=False)
    prepared = PreparedDataset(root / "kept", 1024)
    flat = np.concatenate(
        [np.fromfile(root / "kept" / s.file, dtype=np.uint16) for s in prepared.index.shards]
    )
    flat.tofile(root / "flat.bin")
    single = TokenFileDataset(root / "flat.bin", 1024, dtype="uint16")
    picks = np.random.default_rng(1).integers(0, len(prepared), 10_000)
    return _read_seconds(prepared, picks), _read_seconds(single, picks), len(prepared.index.shards)


def _child(kind: str, src: str, out: str, tokenizer: str) -> None:
    import pyarrow.parquet  # noqa: F401  (imports are not what is timed)
    import tokenizers  # noqa: F401

    if kind == "datasets":
        import datasets  # noqa: F401
    start = time.perf_counter()
    tokens = (_reference if kind == "reference" else _hf_datasets)(Path(src), Path(out), Path(tokenizer))
    print(time.perf_counter() - start, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--loader-tokens", type=float, default=1e9)
    parser.add_argument("--loader-steps", type=int, default=200)
    parser.add_argument("--parts", nargs="+", choices=["prepare", "loader", "read"],
                        default=["prepare", "loader", "read"])  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        jsonl, parquet, chars = _corpus(root, args.mb, args.files)
        bpe = _bpe_folder(next(iter(sorted(jsonl.iterdir()))), root / "bpe")
        print(f"corpus: {args.files} files each in JSONL and Parquet, {chars / 1e6:.0f} MB of text")
        for label, src in (("JSONL", jsonl), ("Parquet", parquet)) if "prepare" in args.parts else ():
            out = root / "out"
            d9d_one, tokens = _median(lambda src=src, out=out: _prepare(src, out, 1, bpe), args.repeats, out)
            d9d_two, _ = _median(lambda src=src, out=out: _prepare(src, out, 2, bpe), args.repeats, out)
            serial = {"TOKENIZERS_PARALLELISM": "false"}
            ref_one, ref_tokens = _median(
                lambda src=src, out=out, serial=serial: _timed_child("reference", src, out, bpe, serial),
                args.repeats,
                out,
            )
            ref_pool, _ = _median(lambda src=src, out=out: _timed_child("reference", src, out, bpe, {}),
                                  args.repeats, out)  # fmt: skip
            hf, hf_tokens = _median(lambda src=src, out=out: _timed_child("datasets", src, out, bpe, {}),
                                    args.repeats, out)  # fmt: skip
            assert tokens == ref_tokens == hf_tokens, (tokens, ref_tokens, hf_tokens)
            print(f"{label}: {tokens:,} tokens; tokens/s: d9d 1 worker {tokens / d9d_one:,.0f}, 2 workers "
                  f"{tokens / d9d_two:,.0f}; reference 1 core {tokens / ref_one:,.0f}, with the tokenizers "
                  f"thread pool {tokens / ref_pool:,.0f}; datasets.map num_proc=2 {tokens / hf:,.0f}")  # fmt: skip
            rows += [
                row(
                    f"prepare {label}, BPE 8k: d9d 2 workers vs the 1-core reference",
                    ref_one / d9d_two,
                    ">= 1.7 (2 cores)",
                    f"{tokens:,} tokens",
                ),
                row(
                    f"prepare {label}: d9d 2 workers vs the reference with tokenizers' thread pool",
                    ref_pool / d9d_two,
                    ">= 1",
                    "",
                ),
                row(
                    f"prepare {label}: d9d 2 workers vs datasets.map(num_proc=2) + numpy write",
                    hf / d9d_two,
                    ">= 1",
                    "",
                ),
                row(
                    f"prepare {label}: d9d 1 worker vs the reference with the thread pool",
                    ref_pool / d9d_one,
                    "1",
                    "",
                ),
            ]
        if "read" in args.parts:
            read_prepared, read_single, shards = _reads(jsonl, root, bpe)
            print(f"10,000 random samples of 1,024 tokens: prepared folder {read_prepared:.3f} s, one token file "
                  f"{read_single:.3f} s")  # fmt: skip
            rows.append(row("read samples: prepared folder vs one token file", read_prepared / read_single, "1",
                            f"{shards} shards"))  # fmt: skip
        if "loader" not in args.parts:
            write_rows(args.json, rows)
            return
        tokens_per_s, read = _loader(root / "loader", int(args.loader_tokens), args.loader_steps)
        print(f"loader: {int(args.loader_tokens):,}-token mixture of 3 sources at seq 8192, {read:,} tokens read: "
              f"{tokens_per_s:,.0f} tokens/s = {tokens_per_s / H100_8B_TOKENS_PER_S:,.0f}x one H100 rank of an 8B "
              "run")  # fmt: skip
        rows.append(row("loader tokens/s vs one H100 rank of Llama 3 8B (~6k tokens/s)",
                        tokens_per_s / H100_8B_TOKENS_PER_S, ">> 1", f"{int(args.loader_tokens):,} tokens"))  # fmt: skip
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
