import importlib.util
import io
import pickle

import msgspec
import numpy as np
import pytest
import torch

from d9d.data import (
    AutoDataConfig,
    AutoDataProvider,
    ByteTokenizer,
    DatasetError,
    TextDataset,
    TokenFileDataset,
    TokenFileInfo,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    write_token_file,
)

HAS_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = {
        "a.txt": "It was the best of times, it was the worst of times.\n" * 20,
        "b.txt": "Call me Ishmael. Some years ago — never mind how long precisely — ...\n" * 15,
        "notes.md": "not a .txt file, so not part of the corpus",
    }
    for name, text in texts.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder, [texts["a.txt"], texts["b.txt"]]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_samples_are_shifted_windows(tmp_path, dtype):
    tokens = np.random.default_rng(0).integers(0, 60_000, size=1_001).astype(dtype)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    dataset = TokenFileDataset(path, seq_len=100, dtype=dtype)
    assert len(dataset) == 10 and dataset.num_tokens == 1_001
    for i in (0, 4, 9, -1):
        sample = dataset[i]
        start = (i % 10) * 100
        assert sample["input_ids"].dtype == torch.int64 and sample["input_ids"].shape == (100,)
        assert sample["input_ids"].tolist() == tokens[start : start + 100].tolist()
        assert sample["labels"].tolist() == tokens[start + 1 : start + 101].tolist()
    with pytest.raises(IndexError):
        dataset[10]
    clone = pickle.loads(pickle.dumps(dataset))  # what a loader worker receives: no copy of the tokens
    assert len(pickle.dumps(dataset)) < 2_000
    assert torch.equal(clone[3]["labels"], dataset[3]["labels"])


def test_token_file_errors_name_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="write_token_file"):
        TokenFileDataset(tmp_path / "missing.bin", seq_len=8)
    path = tmp_path / "tokens.bin"
    np.arange(11, dtype=np.uint16).tofile(path)
    with pytest.raises(DatasetError, match=r"no sidecar tokens\.bin\.json naming its dtype; pass dtype="):
        TokenFileDataset(path, seq_len=8)
    with pytest.raises(DatasetError, match="not a whole number of uint32 tokens"):
        TokenFileDataset(path, seq_len=2, dtype="uint32")
    with pytest.raises(
        DatasetError, match=r"holds 11 tokens, too few for one sample of seq_len=16 \(needs 17\)"
    ):
        TokenFileDataset(path, seq_len=16, dtype="uint16")
    with pytest.raises(DatasetError, match="not supported"):
        TokenFileDataset(path, seq_len=4, dtype="int8")
    (tmp_path / "tokens.bin.json").write_text('{"dtype": 16}')
    with pytest.raises(DatasetError, match="not a valid token-file description"):
        TokenFileDataset(path, seq_len=4)


def test_write_token_file_round_trips_text(tmp_path, corpus):
    folder, texts = corpus
    out = io.StringIO()
    info = write_token_file(folder, tmp_path / "out" / "corpus.bin", stream=out)
    assert "tokenizing" in out.getvalue() and "100.0%" in out.getvalue()
    tok = ByteTokenizer()
    expected = [*tok.encode(texts[0]).tolist(), 256, *tok.encode(texts[1]).tolist(), 256]
    assert info.num_tokens == len(expected) and info.dtype == "uint16" and info.eos_id == 256
    sidecar = msgspec.json.decode((tmp_path / "out" / "corpus.bin.json").read_bytes(), type=TokenFileInfo)
    assert sidecar == info and [s.rsplit("/", 1)[-1] for s in sidecar.sources] == ["a.txt", "b.txt"]
    dataset = TokenFileDataset(tmp_path / "out" / "corpus.bin", seq_len=64)  # dtype from the sidecar
    assert dataset.tokens.tolist() == expected
    assert tok.decode(dataset[0]["input_ids"]) == texts[0][:64]
    assert not list((tmp_path / "out").glob(".*tmp*")), "no temporary file is left behind"


def test_text_dataset_packs_documents_like_the_token_file(tmp_path, corpus):
    folder, texts = corpus
    dataset = TextDataset(folder, seq_len=32)
    assert [f.name for f in dataset.files] == ["a.txt", "b.txt"]
    assert isinstance(dataset.tokenizer, Tokenizer)
    write_token_file(dataset.files, tmp_path / "c.bin", progress=False)
    from_file = TokenFileDataset(tmp_path / "c.bin", seq_len=32)
    assert len(dataset) == len(from_file) == (len(texts[0].encode()) + len(texts[1].encode()) + 1) // 32
    for i in (0, 7, len(dataset) - 1):
        assert torch.equal(dataset[i]["input_ids"], from_file[i]["input_ids"])
        assert torch.equal(dataset[i]["labels"], from_file[i]["labels"])
    assert dataset.tokenizer.decode(dataset.tokens[: len(texts[0].encode()) + 1]) == texts[0] + "\n"


def test_text_dataset_errors(tmp_path, corpus):
    folder, _ = corpus
    with pytest.raises(DatasetError, match="no text file or folder at"):
        TextDataset(tmp_path / "nowhere", seq_len=8)
    with pytest.raises(DatasetError, match=r"holds no \*.txt files"):
        TextDataset(_empty(tmp_path), seq_len=8)
    with pytest.raises(DatasetError, match="too few for one sample"):
        TextDataset(folder / "a.txt", seq_len=100_000)


def _empty(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


def test_tokenizer_json_needs_an_existing_file_and_the_optional_package(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer file at"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "text.txt").write_text("some text")
    if HAS_TOKENIZERS:
        with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
            load_tokenizer(tmp_path)
    else:
        with pytest.raises(TokenizerError, match="optional `tokenizers` package"):
            TextDataset(tmp_path / "text.txt", seq_len=8, tokenizer=tmp_path / "tokenizer.json")


def test_token_dataset_through_the_provider_with_workers(tmp_path):
    tokens = np.arange(4_097, dtype=np.uint32) % 50_000
    tokens.tofile(tmp_path / "t.bin")
    dataset = TokenFileDataset(tmp_path / "t.bin", seq_len=64, dtype="uint32")
    config = AutoDataConfig(global_batch_size=8, microbatch_size=4, num_workers=1)
    with AutoDataProvider(config, dataset) as provider:
        step = next(provider)
    assert len(step) == 2 and step[0]["input_ids"].shape == (4, 64)
    assert torch.equal(step[0]["labels"][:, :-1], step[0]["input_ids"][:, 1:])


def test_datasets_declare_the_vocabulary_their_ids_come_from(tmp_path, corpus):
    folder, _ = corpus
    assert TextDataset(folder, seq_len=8).vocab_size == 257  # 256 bytes + end of document
    write_token_file(folder, tmp_path / "t.bin", stream=io.StringIO())
    assert TokenFileDataset(tmp_path / "t.bin", seq_len=8).vocab_size == 257  # from the sidecar
    (tmp_path / "t.bin.json").unlink()
    assert TokenFileDataset(tmp_path / "t.bin", seq_len=8, dtype="uint16").vocab_size is None  # unknown
