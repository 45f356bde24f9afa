"""Throughput of `d9d data prepare` (`d9d.data.prepare_dataset`) and of reading what it wrote.

    uv run python benchmarks/data_prepare.py [--files 8] [--docs 4000] [--out rows.json]

A synthetic JSONL corpus (`--files` files of `--docs` documents of ~1 KB each, written once in a
temporary folder) is prepared by 1 and by 2 worker processes, with the byte tokenizer and with a
BPE tokenizer of 8,000 ids trained on the corpus by the `tokenizers` library (the `chat` extra; a
Hugging Face tokenizer folder, as real corpora use); the rows are tokens/s with 2 workers vs 1 (ideal:
the number of workers, on an otherwise idle machine with a core each) and the time to read 10,000 random samples of 1,024 tokens from the prepared folder
(`PreparedDataset`, every shard memory-mapped) vs the same tokens in one token file
(`TokenFileDataset`; ideal 1: several shards cost nothing). Wall times are the median of 3 runs.
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import row, write_rows

from d9d.data import PreparedDataset, TokenFileDataset, prepare_dataset


def _corpus(root: Path, files: int, docs: int) -> int:
    rng = np.random.default_rng(0)
    words = np.array(["the", "of", "and", "to", "in", "training", "model", "data", "token", "parallel"])
    size = 0
    for f in range(files):
        with (root / f"part-{f:03d}.jsonl").open("w", encoding="utf-8") as out:
            for _ in range(docs):
                text = " ".join(rng.choice(words, 170))
                out.write(json.dumps({"text": text}) + "\n")
                size += len(text)
    return size


def _bpe_folder(src: Path, folder: Path) -> Path:
    """A BPE tokenizer trained on the corpus, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "</s>"])
    texts = (
        json.loads(line)["text"] for f in sorted(src.glob("*.jsonl")) for line in f.open(encoding="utf-8")
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    return folder


def _prepare_seconds(src: Path, out: Path, workers: int, tokenizer: Path | None) -> tuple[float, int]:
    times = []
    tokens = 0
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        index = prepare_dataset(src, out, workers=workers, tokenizer=tokenizer, progress=False)
        times.append(time.perf_counter() - start)
        tokens = index.tokens
    return statistics.median(times), tokens


def _read_seconds(dataset: object, picks: np.ndarray) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for i in picks:
            dataset[int(i)]  # type: ignore[index]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "src"
        src.mkdir()
        chars = _corpus(src, args.files, args.docs)
        bpe = _bpe_folder(src, root / "bpe")
        one, tokens = _prepare_seconds(src, root / "one", 1, None)
        two, _ = _prepare_seconds(src, root / "two", 2, None)
        bpe_one, bpe_tokens = _prepare_seconds(src, root / "bpe-one", 1, bpe)
        bpe_two, _ = _prepare_seconds(src, root / "bpe-two", 2, bpe)
        prepared = PreparedDataset(root / "one", 1024)
        flat = np.concatenate(
            [np.fromfile(root / "one" / s.file, dtype=np.uint16) for s in prepared.index.shards]
        )
        flat.tofile(root / "flat.bin")
        single = TokenFileDataset(root / "flat.bin", 1024, dtype="uint16")
        picks = np.random.default_rng(1).integers(0, len(prepared), 10_000)
        read_prepared = _read_seconds(prepared, picks)
        read_single = _read_seconds(single, picks)
    print(f"corpus: {args.files} files, {chars / 1e6:.1f} MB of text, {tokens:,} tokens")
    print(
        f"prepare, byte tokenizer: 1 worker {tokens / one:,.0f} tokens/s, 2 workers {tokens / two:,.0f} tokens/s"
    )
    print(
        f"prepare, BPE 8k: 1 worker {bpe_tokens / bpe_one:,.0f} tokens/s, 2 workers {bpe_tokens / bpe_two:,.0f} "
        "tokens/s"
    )
    print(
        f"10,000 random samples of 1,024 tokens: prepared folder {read_prepared:.3f} s, one token file "
        f"{read_single:.3f} s"
    )
    rows = [
        row(
            "prepare, byte tokenizer: tokens/s, 2 workers vs 1",
            one / two,
            "2 (one core each)",
            f"{tokens:,} tokens",
        ),
        row(
            "prepare, BPE 8k: tokens/s, 2 workers vs 1",
            bpe_one / bpe_two,
            "2 (one core each)",
            f"{bpe_tokens:,} tokens",
        ),
        row(
            "read samples: prepared folder vs one token file",
            read_prepared / read_single,
            "1",
            f"{len(prepared.index.shards)} shards",
        ),
    ]
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
