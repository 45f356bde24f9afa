"""`RunTokenizer`: the run directory keeps a copy of the dataset tokenizer's files (written once, by the
writing process, replaced with a warning when a resumed run trains with another tokenizer); read back,
the copy is the run's tokenizer and what an export carries; the byte tokenizer has nothing to keep."""

import json
from pathlib import Path

import pytest

from d9d.data import ByteTokenizer, load_tokenizer, tokenizer_digest, tokenizer_files_at
from d9d.trainer.run import tokenizer as run_tokenizer
from d9d.trainer.run.tokenizer import RunTokenizer


class _Warnings:
    """Stands in for the module's logger: the warnings it was given."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def warning(self, event: str, **fields: object) -> None:
        self.events.append(event)


def _tokenizer(folder: Path, words: list[str]):
    """A word-level tokenizer folder over `words` (EOS "</s>"), loaded."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["</s>", "[UNK]", *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    return load_tokenizer(folder)


def test_the_run_keeps_its_tokenizer_once_and_reads_the_copy_back(tmp_path, monkeypatch):
    warnings = _Warnings()
    monkeypatch.setattr(run_tokenizer, "_log", warnings)
    first = _tokenizer(tmp_path / "first", ["call", "me"])
    run = tmp_path / "run"
    RunTokenizer(run, first, read_only=False, is_main_process=False).record()
    assert not (run / "tokenizer").exists()  # only the writing process copies
    RunTokenizer(run, first, read_only=True, is_main_process=True).record()
    assert not (run / "tokenizer").exists()  # a run read back writes nothing
    training = RunTokenizer(run, first, read_only=False, is_main_process=True)
    training.record()
    assert tokenizer_digest(tokenizer_files_at(run / "tokenizer")) == tokenizer_digest(first.files)
    assert training.tokenizer is first and training.files() == first.files
    (run / "tokenizer" / "tokenizer.json").unlink()
    training.record()  # once per job
    assert not (run / "tokenizer" / "tokenizer.json").exists()
    training = RunTokenizer(run, first, read_only=False, is_main_process=True)
    training.record()
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert warnings.events == []  # the same files: no warning
    # resumed with another tokenizer: the copy follows, with a warning
    second = _tokenizer(tmp_path / "second", ["ishmael"])
    RunTokenizer(run, second, read_only=False, is_main_process=True).record()
    assert warnings.events == [
        "the run trains with another tokenizer than its earlier checkpoints; the run's copy is replaced"
    ]
    assert tokenizer_digest(tokenizer_files_at(run / "tokenizer")) == tokenizer_digest(second.files)
    # read back, the copy is the tokenizer even when the dataset now gives another, or none
    for dataset_tokenizer in (first, None):
        back = RunTokenizer(run, dataset_tokenizer, read_only=True, is_main_process=True)
        assert list(back.tokenizer.encode("ishmael call")) == list(second.encode("ishmael call"))
        assert back.files() == tokenizer_files_at(run / "tokenizer")


def test_the_byte_tokenizer_has_nothing_to_keep(tmp_path):
    byte = ByteTokenizer()
    training = RunTokenizer(tmp_path / "run", byte, read_only=False, is_main_process=True)
    training.record()
    assert not (tmp_path / "run").exists() and training.files() == {}
    assert RunTokenizer(tmp_path / "run", byte, read_only=True, is_main_process=True).tokenizer is byte
    assert RunTokenizer(tmp_path / "run", None, read_only=True, is_main_process=True).tokenizer is None
