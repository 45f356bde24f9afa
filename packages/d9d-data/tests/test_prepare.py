"""`prepare_dataset` / `PreparedDataset`: the tokens of every document with an EOS after each, the
same bytes for any number of workers, a killed prepare continues without redoing finished shards,
and bad sources are refused with the file and line, leaving nothing half-written."""

import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from d9d.data import ByteTokenizer, DatasetError, PreparedDataset, prepare_dataset, read_index


def _corpus(root: Path) -> tuple[Path, list[str]]:
    """A source folder of .txt, .jsonl and .jsonl.gz files, and its documents in prepare order."""
    src = root / "src"
    (src / "web").mkdir(parents=True)
    docs: list[str] = []
    book = "It was the best of times, it was the worst of times.\n" * 7
    (src / "a_book.txt").write_text(book, encoding="utf-8")
    lines = [{"text": f"page {i}: " + "lorem ipsum " * (i % 5 + 1), "id": i} for i in range(40)]
    (src / "web" / "b.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines[:25]) + "\n", encoding="utf-8"
    )  # a blank last line is skipped
    with gzip.open(src / "web" / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines[25:]))
    (src / "notes.md").write_text("not a source", encoding="utf-8")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "skip.txt").write_text("hidden folders are skipped", encoding="utf-8")
    docs = [book, *(r["text"] for r in lines)]
    return src, docs


def test_a_prepared_folder_holds_every_document_followed_by_eos_and_reads_as_samples(tmp_path):
    src, docs = _corpus(tmp_path)
    index = prepare_dataset(src, tmp_path / "out", progress=False)
    tok = ByteTokenizer()
    expected = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs]).astype(np.int64)
    assert [Path(s.source).name for s in index.shards] == ["a_book.txt", "b.jsonl", "c.jsonl.gz"]
    assert [s.documents for s in index.shards] == [1, 25, 15]
    assert index.documents == len(docs) and index.tokens == len(expected)
    assert read_index(tmp_path / "out") == index
    dataset = PreparedDataset(tmp_path / "out", 16, document_masking=True)
    assert len(dataset) == (len(expected) - 1) // 16
    for i in range(len(dataset)):  # windows cross the shard boundaries
        sample = dataset[i]
        assert np.array_equal(sample["input_ids"].numpy(), expected[i * 16 : i * 16 + 16])
        assert np.array_equal(sample["labels"].numpy(), expected[i * 16 + 1 : i * 16 + 17])
    assert dataset.vocab_size == tok.vocab_size and dataset.eos_id == tok.eos_id
    copy = pickle.loads(pickle.dumps(dataset))  # what a loader worker gets: it reopens the maps
    assert np.array_equal(
        copy[len(dataset) - 1]["input_ids"].numpy(), dataset[len(dataset) - 1]["input_ids"].numpy()
    )


def test_the_output_is_the_same_bytes_whatever_the_number_of_workers(tmp_path):
    src, _ = _corpus(tmp_path)
    prepare_dataset(src, tmp_path / "one", workers=1, progress=False)
    prepare_dataset(src, tmp_path / "three", workers=3, progress=False)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == ["index.json", "shard-00000.bin", "shard-00001.bin", "shard-00002.bin"]
    assert names == sorted(p.name for p in (tmp_path / "three").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name


def test_a_finished_prepare_run_again_returns_at_once_and_another_corpus_there_is_refused(tmp_path):
    src, _ = _corpus(tmp_path)
    first = prepare_dataset(src, tmp_path / "out", progress=False)
    stamp = (tmp_path / "out" / "shard-00000.bin").stat().st_mtime_ns
    stamps = [(tmp_path / "out" / s.file).stat().st_mtime_ns for s in first.shards]
    assert prepare_dataset(src, tmp_path / "out", progress=False) == first
    assert (tmp_path / "out" / "shard-00000.bin").stat().st_mtime_ns == stamp
    with pytest.raises(DatasetError, match="already holds a prepared dataset of other sources"):
        prepare_dataset(src / "web", tmp_path / "out", progress=False)
    with pytest.raises(DatasetError, match=r"of other settings \(text_key\)"):
        prepare_dataset(src, tmp_path / "out", text_key="body", progress=False)
    book = src / "a_book.txt"  # one character changed in place: the same size, a new modification time
    text = book.read_text(encoding="utf-8")
    book.write_text("I" + text[1:], encoding="utf-8")
    os.utime(book, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(DatasetError, match=r"of sources that changed since \(e\.g\. .*a_book\.txt\)"):
        prepare_dataset(src, tmp_path / "out", progress=False)
    # an interrupted prepare redoes the changed source's shard and keeps the others
    (tmp_path / "out" / "index.json").unlink()
    (tmp_path / "out" / ".prepare").mkdir()
    for shard in first.shards:
        record = {"dtype": first.dtype, "tokenizer": first.tokenizer, "text_key": "text", "vocab_size": first.vocab_size,
                  "eos_id": first.eos_id, "tokenizer_sha256": "", **msgspec.to_builtins(shard)}  # fmt: skip
        (tmp_path / "out" / ".prepare" / f"{shard.file}.json").write_text(
            json.dumps(record), encoding="utf-8"
        )
    again = prepare_dataset(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "shard-00000.bin").read_bytes().startswith(b"I")
    assert (tmp_path / "out" / "shard-00001.bin").stat().st_mtime_ns == stamps[1]  # kept
    assert again.shards[1:] == first.shards[1:]


_KILLED_PREPARE = """
import sys, time
from pathlib import Path
import d9d.data.prepare.pool as pool
from d9d.data import prepare_dataset

real = pool.tokenize_shard
def slow(job, tok, out):
    shard = real(job, tok, out)
    if job.index >= 1:  # shard 1 is written (renamed) but its worker never returns: killed here
        print("stalled", flush=True)
        time.sleep(120)
    return shard
pool.tokenize_shard = slow
prepare_dataset(sys.argv[1], sys.argv[2], progress=False)
"""


def test_a_killed_prepare_continues_without_redoing_finished_shards_and_ends_identical(tmp_path):
    src, _ = _corpus(tmp_path)
    out = tmp_path / "out"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(_KILLED_PREPARE), encoding="utf-8")
    child = subprocess.Popen(
        [sys.executable, str(script), str(src), str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "stalled"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    assert not (out / "index.json").exists()  # not a dataset yet, and it says why
    with pytest.raises(DatasetError, match="did not finish: run it again"):
        PreparedDataset(out, 16)
    kept = (out / "shard-00000.bin").stat().st_mtime_ns
    time.sleep(0.01)
    resumed = prepare_dataset(src, out, progress=False)
    assert (out / "shard-00000.bin").stat().st_mtime_ns == kept  # finished: not redone
    fresh = prepare_dataset(src, tmp_path / "fresh", progress=False)
    assert resumed == fresh
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (tmp_path / "fresh").iterdir())
    for shard in fresh.shards:
        assert (out / shard.file).read_bytes() == (tmp_path / "fresh" / shard.file).read_bytes()


def _jsonl(path: Path, *rows: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            ['{"text": "fine"}', '{"content": "no text key"}'],
            r"bad\.jsonl:2: no 'text' key \(its keys: content\)",
        ),
        (['{"text": "fine"}', '{"text": 7}'], r"bad\.jsonl:2: 'text' is a int, not a string"),
        (['{"text": "fine"}', "{not json"], r"bad\.jsonl:2: not a JSON object"),
        (['["a", "list"]'], r"bad\.jsonl:1: a list, not a JSON object"),
        (["", "  "], r"bad\.jsonl holds no documents"),
    ],
)
def test_a_bad_source_is_refused_with_file_and_line_and_leaves_no_shard_of_it(tmp_path, rows, message):
    src, _ = _corpus(tmp_path)
    _jsonl(src / "web" / "bad.jsonl", *rows)
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match=message) as refused:
        prepare_dataset(src, out, progress=False)
    assert "\n" not in str(refused.value)
    assert not (out / "index.json").exists()
    assert not list(out.glob(".shard-*"))  # the failed shard is neither visible nor left as a temporary
    failed = [s for s in sorted(out.glob("shard-*.bin"))]
    assert len(failed) < 4  # the bad source's shard (index 2 of 4) is not there
    assert not (out / "shard-00002.bin").exists()


def test_missing_sources_and_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(DatasetError, match="no source file or folder at"):
        prepare_dataset(tmp_path / "nothing", tmp_path / "out", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"holds no \.txt/\.jsonl"):
        prepare_dataset(tmp_path / "empty", tmp_path / "out", progress=False)
    (tmp_path / "doc.md").write_text("x", encoding="utf-8")
    with pytest.raises(DatasetError, match="is not a source d9d reads"):
        prepare_dataset(tmp_path / "doc.md", tmp_path / "out", progress=False)
    src, _ = _corpus(tmp_path)
    with pytest.raises(DatasetError, match="workers must be an integer >= 1"):
        prepare_dataset(src, tmp_path / "out", workers=0, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_parquet_source_without_pyarrow_names_the_extra(tmp_path):
    try:
        import pyarrow  # noqa: F401

        pytest.skip("pyarrow is installed: the refusal is not reachable")
    except ImportError:
        pass
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"needs pyarrow .*parquet.* extra"):
        prepare_dataset(tmp_path / "src", tmp_path / "out", progress=False)


def test_a_damaged_prepared_folder_is_refused(tmp_path):
    src, _ = _corpus(tmp_path)
    prepare_dataset(src, tmp_path / "out", progress=False)
    shard = tmp_path / "out" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"shard-00001\.bin is .* bytes, but .*index\.json says"):
        PreparedDataset(tmp_path / "out", 16)
    with pytest.raises(DatasetError, match="no prepared dataset folder"):
        PreparedDataset(tmp_path / "missing", 16)


def test_parquet_and_zstandard_jsonl_sources_give_the_documents_of_their_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    zstandard = pytest.importorskip("zstandard")
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"row {i} " * (i + 1) for i in range(12)]
    pq.write_table(pa.table({"content": texts[:7], "n": list(range(7))}), src / "a.parquet", row_group_size=3)
    raw = "".join(json.dumps({"content": t}) + "\n" for t in texts[7:]).encode()
    (src / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    index = prepare_dataset(src, tmp_path / "out", text_key="content", workers=2, progress=False)
    assert [s.documents for s in index.shards] == [7, 5]
    tok = ByteTokenizer()
    expected = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in texts])
    dataset = PreparedDataset(tmp_path / "out", 8)
    assert np.array_equal(dataset.read(0, dataset.num_tokens), expected)
    # a Parquet row that is not a string names the file and the row
    pq.write_table(pa.table({"content": ["fine", None]}), src / "c.parquet")
    with pytest.raises(DatasetError, match=r"c\.parquet: row 1: 'content' is null, not a string"):
        prepare_dataset(src, tmp_path / "out2", text_key="content", progress=False)
    with pytest.raises(DatasetError, match=r"a\.parquet: no 'text' column \(its columns: content, n\)"):
        prepare_dataset(src / "a.parquet", tmp_path / "out3", progress=False)


def test_a_saved_hugging_face_dataset_is_a_source_and_a_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    src = tmp_path / "src"
    texts = [f"record {i} " * (i + 2) for i in range(9)]
    datasets.Dataset.from_dict({"content": texts, "n": list(range(9))}).save_to_disk(
        str(src / "hub" / "train")
    )
    (src / "z.txt").write_text("a text file after it", encoding="utf-8")
    index = prepare_dataset(src, tmp_path / "out", text_key="content", progress=False)
    assert [Path(s.source).name for s in index.shards] == ["train", "z.txt"]  # the folder is one source
    assert [s.documents for s in index.shards] == [9, 1]
    tok = ByteTokenizer()
    expected = np.concatenate(
        [np.append(tok.encode(t), tok.eos_id) for t in [*texts, "a text file after it"]]
    )
    dataset = PreparedDataset(tmp_path / "out", 8)
    assert np.array_equal(dataset.read(0, dataset.num_tokens), expected)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]}),
                                   "test": datasets.Dataset.from_dict({"text": ["y"]})})  # fmt: skip
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(
        DatasetError, match=r"dict is a saved DatasetDict of splits test, train; name the folder"
    ):
        prepare_dataset(tmp_path / "dict", tmp_path / "out2", progress=False)
    with pytest.raises(DatasetError, match=r"train: no 'text' column \(its columns: content, n\)"):
        prepare_dataset(src / "hub" / "train", tmp_path / "out3", progress=False)


def test_a_bad_source_with_two_workers_stops_the_prepare_keeping_what_finished(tmp_path):
    import multiprocessing

    src, _ = _corpus(tmp_path)
    bad = _jsonl(src / "web" / "b2.jsonl", '{"text": "fine"}', '{"body": "no text key"}')
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match=r"b2\.jsonl:2: no 'text' key"):
        prepare_dataset(src, out, workers=2, progress=False)
    assert not multiprocessing.active_children()  # no worker left running
    assert not (out / "index.json").exists() and not list(out.glob(".shard-*"))
    recorded = {p.name.removesuffix(".json") for p in (out / ".prepare").glob("*.json")}
    stamps = {name: (out / name).stat().st_mtime_ns for name in recorded}
    bad.write_text('{"text": "fine"}\n{"text": "fixed"}\n', encoding="utf-8")
    resumed = prepare_dataset(src, out, workers=2, progress=False)
    assert all((out / name).stat().st_mtime_ns == stamp for name, stamp in stamps.items())  # kept
    assert resumed == prepare_dataset(src, tmp_path / "fresh", progress=False)


def test_a_folder_of_more_shards_than_open_files_reads_every_window(tmp_path, monkeypatch):
    import d9d.data.datasets.prepared as prepared

    monkeypatch.setattr(prepared, "OPEN_SHARDS", 2)
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document number {i}. " * (3 + i) for i in range(7)]
    for i, text in enumerate(texts):
        (src / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    prepare_dataset(src, tmp_path / "out", workers=2, progress=False)
    dataset = PreparedDataset(tmp_path / "out", 8)
    tok = ByteTokenizer()
    expected = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in texts])
    order = np.random.default_rng(0).permutation(len(dataset))  # jumps between the 7 shards
    for i in order:
        assert np.array_equal(dataset[int(i)]["input_ids"].numpy(), expected[i * 8 : i * 8 + 8])
        assert len(dataset._open) <= 2
    dataset.close()
    assert not dataset._open


def test_a_hugging_face_tokenizer_folder_encodes_in_batches_exactly_as_one_document_at_a_time(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from d9d.data import load_tokenizer

    src, docs = _corpus(tmp_path)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        docs, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    index = prepare_dataset(src, tmp_path / "out", tokenizer=folder, workers=2, progress=False)
    loaded = load_tokenizer(folder)
    expected = np.concatenate([np.append(loaded.encode(d), loaded.eos_id) for d in docs])  # one by one
    dataset = PreparedDataset(tmp_path / "out", 8)
    assert np.array_equal(dataset.read(0, dataset.num_tokens), expected)
    assert index.vocab_size == tok.get_vocab_size() and index.eos_id == tok.token_to_id("</s>")
    assert index.tokenizer_sha256


def test_a_disk_that_fills_stops_the_prepare_in_one_line_keeping_what_finished(tmp_path, monkeypatch):
    """The kernel's own ENOSPC: the second shard's temporary file is /dev/full."""
    import d9d.data.prepare.writer as writer

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first source. " * 50, encoding="utf-8")
    (src / "b.txt").write_text("second source. " * 50, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(writer, "remove_temporaries", lambda out: None)  # keep the planted file
    (out / f".shard-00001.bin.tmp-{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(DatasetError) as caught:
        prepare_dataset(src, out, progress=False)
    message = str(caught.value)
    assert "\n" not in message and "no room to write" in message and "No space left on device" in message
    assert "run the same command again" in message
    assert not (out / "index.json").exists()  # nothing half-visible: no index, no shard 1, no temporary
    assert sorted(p.name for p in out.iterdir()) == [".prepare", "shard-00000.bin"]
    monkeypatch.undo()
    assert prepare_dataset(src, out, progress=False) == prepare_dataset(
        src, tmp_path / "fresh", progress=False
    )


def test_a_file_size_limit_reached_by_the_cli_is_one_line_and_exit_status_2(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("small. " * 10, encoding="utf-8")
    (src / "b.txt").write_text("large source. " * 20_000, encoding="utf-8")  # 280 KB: 560 KB of uint16
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
        "from d9d.cli import main; sys.argv = ['d9d'] + sys.argv[1:]; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, "data", "prepare", str(src), "--out", str(tmp_path / "out"),
         "--workers", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    assert "no room to write" in line and "shard-00001.bin" in line and "File too large" in line, line
    assert not (tmp_path / "out" / "index.json").exists()
    assert (
        not list((tmp_path / "out").glob(".shard-*")) and not (tmp_path / "out" / "shard-00001.bin").exists()
    )
