"""A tokenizer's files follow what is made with it: a prepared folder keeps a copy (it reads from
anywhere, moved or not, and its tokenizer encodes as the source did); a folder prepared before the copy
still finds its tokenizer where it was (checked by digest) or says how to get the copy; copying
tokenizer files makes a folder's tokenizer files exactly those (tokenizer.json last)."""

import json
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from d9d.data import (
    TOKENIZER_FILES,
    ByteTokenizer,
    PreparedDataset,
    TokenizerError,
    copy_tokenizer_files,
    load_tokenizer,
    prepare_dataset,
    read_index,
    tokenizer_digest,
    tokenizer_files,
    tokenizer_files_at,
)

TEXT = "It was the best of times, it was the worst of times. " * 20


def make_tokenizer(folder: Path) -> Path:
    """A small BPE tokenizer folder (tokenizer.json, tokenizer_config.json with its EOS, a chat template)."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [TEXT], tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    return folder


def test_a_prepared_folder_keeps_its_tokenizer_and_reads_it_from_anywhere_once_moved(tmp_path, monkeypatch):
    make_tokenizer(tmp_path / "here" / "tok")
    (tmp_path / "here" / "doc.txt").write_text(TEXT, encoding="utf-8")
    monkeypatch.chdir(tmp_path / "here")
    index = prepare_dataset("doc.txt", "prepared", tokenizer="tok", progress=False)
    assert index.tokenizer == str(tmp_path / "here" / "tok" / "tokenizer.json")  # not "tok/..."
    assert index.tokenizer_folder == "tokenizer"
    copy = tmp_path / "here" / "prepared" / "tokenizer"
    assert sorted(p.name for p in copy.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert index.tokenizer_sha256 == tokenizer_digest(tokenizer_files_at(copy))  # the same bytes
    source = load_tokenizer(tmp_path / "here" / "tok")
    shutil.move(tmp_path / "here" / "prepared", tmp_path / "moved")
    shutil.rmtree(tmp_path / "here")  # the tokenizer's source is gone too
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    dataset = PreparedDataset("../moved", 8)
    tok = dataset.load_tokenizer()
    assert np.array_equal(tok.encode(TEXT), source.encode(TEXT)) and tok.eos_id == source.eos_id
    assert tok.chat_template == source.chat_template
    assert np.array_equal(dataset.read(0, 5), tok.encode(TEXT)[:5])


def test_the_byte_tokenizer_has_no_files_to_keep(tmp_path):
    (tmp_path / "doc.txt").write_text(TEXT, encoding="utf-8")
    index = prepare_dataset(tmp_path / "doc.txt", tmp_path / "prepared", progress=False)
    assert (index.tokenizer, index.tokenizer_folder, index.tokenizer_sha256) == ("byte", "", "")
    assert not (tmp_path / "prepared" / "tokenizer").exists()
    assert isinstance(PreparedDataset(tmp_path / "prepared", 8).load_tokenizer(), ByteTokenizer)
    assert tokenizer_files(ByteTokenizer()) == {}


def test_a_folder_prepared_before_the_copy_finds_its_tokenizer_by_digest_or_says_how_to_get_it(
    tmp_path, monkeypatch
):
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "doc.txt").write_text(TEXT, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    prepare_dataset("doc.txt", "prepared", tokenizer="tok", progress=False)
    # what an earlier d9d wrote: the tokenizer as given (relative), no copy, the same format
    old = msgspec.structs.replace(read_index(tmp_path / "prepared"), tokenizer="tok/tokenizer.json",
                                  tokenizer_folder="")  # fmt: skip
    raw = msgspec.to_builtins(old)
    del raw["tokenizer_folder"]
    (tmp_path / "prepared" / "index.json").write_text(json.dumps(raw), encoding="utf-8")
    shutil.rmtree(tmp_path / "prepared" / "tokenizer")
    assert read_index(tmp_path / "prepared").tokenizer_folder == ""  # an old index reads as it is
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    dataset = PreparedDataset(tmp_path / "prepared", 8)  # reads from anywhere
    expected = load_tokenizer(tmp_path / "tok").encode(TEXT)
    # found beside the folder (from another directory) and from where the prepare ran
    for cwd in (tmp_path / "elsewhere", tmp_path):
        monkeypatch.chdir(cwd)
        assert np.array_equal(dataset.load_tokenizer().encode(TEXT), expected)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<unk>"}), encoding="utf-8"
    )
    with pytest.raises(
        TokenizerError, match=r"not there .* with the same files.*run the same d9d data prepare again"
    ):
        dataset.load_tokenizer()  # a tokenizer changed since is not the one the folder was made with
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>"}), encoding="utf-8"
    )
    # the same prepare command again adds the copy and keeps the shards
    shard = (tmp_path / "prepared" / "shard-00000.bin").stat().st_mtime_ns
    index = prepare_dataset("doc.txt", "prepared", tokenizer="tok", progress=False)
    assert index.tokenizer_folder == "tokenizer" and read_index(tmp_path / "prepared") == index
    assert (tmp_path / "prepared" / "shard-00000.bin").stat().st_mtime_ns == shard
    shutil.rmtree(tmp_path / "tok")
    assert np.array_equal(PreparedDataset(tmp_path / "prepared", 8).load_tokenizer().encode(TEXT), expected)


def test_copied_tokenizer_files_replace_another_tokenizers_and_the_vocabulary_comes_last(
    tmp_path, monkeypatch
):
    source = make_tokenizer(tmp_path / "tok")
    (source / "chat_template.jinja").unlink()
    target = tmp_path / "export"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "chat_template.jinja").write_text("another tokenizer's", encoding="utf-8")
    written: list[str] = []
    real = Path.replace
    monkeypatch.setattr(Path, "replace", lambda self, to: (written.append(Path(to).name), real(self, to))[1])
    names = copy_tokenizer_files(tokenizer_files(load_tokenizer(source)), target)
    assert names == ["tokenizer.json", "tokenizer_config.json"] and written == [
        "tokenizer_config.json",
        "tokenizer.json",
    ]
    assert sorted(p.name for p in target.iterdir()) == [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert tokenizer_digest(tokenizer_files_at(target)) == tokenizer_digest(tokenizer_files_at(source))
    assert set(TOKENIZER_FILES) >= set(names)
