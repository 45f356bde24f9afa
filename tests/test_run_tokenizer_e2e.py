"""The tokenizer follows the run: a folder `d9d data prepare` made in one directory (its tokenizer
given by a relative path) keeps a copy of the tokenizer, so once moved it trains from another
directory after the tokenizer's source is gone; the run keeps a copy too (`RUN_DIR/tokenizer`), so
`d9d generate RUN_DIR` needs no --tokenizer and encodes the prompt as that tokenizer does; exports (the
whole model, a LoRA run's merged model, `d9d export` from the run) carry the tokenizer files, which
transformers' AutoTokenizer loads and which encode as ours. Commands run forked from this process."""

import json
import shutil
from pathlib import Path

import pytest
from _doc_commands import _forked, _run_cli
from _quickstart import ROOT, TINY, run_main

from d9d.data import TOKENIZER_FILES, load_tokenizer, tokenizer_digest, tokenizer_files_at

PROMPT = "Call me Ishmael. Some years ago"


def _tokenizer_folder(folder: Path) -> None:
    """A byte-level BPE trained on the corpus, saved as a Hugging Face tokenizer folder."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(ROOT / "examples" / "data" / "corpus.txt")], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))  # fmt: skip
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"}), encoding="utf-8"
    )


def _d9d(cwd: Path, *argv: str) -> str:
    """`d9d ARGV` run from `cwd` (forked); what it printed. It must succeed."""
    code, output = _forked(cwd, 300, _run_cli, list(argv))
    assert code == 0, f"d9d {' '.join(argv)}:\n{output[-3000:]}"
    return output


def _generated(cwd: Path, source: Path, *argv: str) -> dict:
    """The one jsonl record of `d9d generate SOURCE --prompt PROMPT` (greedy, a few tokens)."""
    output = _d9d(cwd, "generate", str(source), "--prompt", PROMPT, "--temperature", "0",
                  "--max-new-tokens", "4", "--format", "jsonl", *argv)  # fmt: skip
    (record,) = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return record


def _train(cwd: Path, save_dir: Path, name: str, *extra: str) -> None:
    done = run_main([*TINY, "model.vocab_size=320", "providers.dataset=d9d.trainer:PreparedDataProvider",
                     f"trainer.checkpointing.save_dir={save_dir}", f"trainer.run.name={name}",
                     "trainer.schedule.total_steps=2", *extra], cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A folder prepared in src/ with `--tokenizer tok` (relative), moved to data/prepared, the tokenizer's
    source deleted; and the ids that tokenizer gave the prompt."""
    root = tmp_path_factory.mktemp("tokenizer")
    _tokenizer_folder(root / "src" / "tok")
    shutil.copy(ROOT / "examples" / "data" / "corpus.txt", root / "src" / "corpus.txt")
    _d9d(root / "src", "data", "prepare", "corpus.txt", "--out", "prepared", "--tokenizer", "tok")
    ids = [int(i) for i in load_tokenizer(root / "src" / "tok").encode(PROMPT)]
    (root / "data").mkdir()
    shutil.move(root / "src" / "prepared", root / "data" / "prepared")
    shutil.rmtree(root / "src")
    (root / "job").mkdir()
    return root, ids


def test_a_moved_prepared_folder_trains_from_elsewhere_and_generate_needs_no_tokenizer(moved):
    root, ids = moved
    transformers = pytest.importorskip("transformers")
    export = root / "export"
    # from another directory than the prepare's, where its relative "tok" is no tokenizer
    _train(root / "job", root / "runs", "run", f"dataset={{path: {root / 'data' / 'prepared'}, seq_len: 32}}",
           f"export.dir={export}")  # fmt: skip
    run = root / "runs" / "run"
    kept = tokenizer_files_at(run / "tokenizer")
    assert sorted(kept) == sorted((*TOKENIZER_FILES[:2], "special_tokens_map.json"))
    assert tokenizer_digest(kept) == tokenizer_digest(
        tokenizer_files_at(root / "data" / "prepared" / "tokenizer")
    )
    record = _generated(root, run)  # no --tokenizer
    assert record["prompt_ids"] == ids and record["step"] == 2
    # the export holds the tokenizer files: transformers loads them and encodes like ours
    assert sorted(p.name for p in export.iterdir() if p.name in TOKENIZER_FILES) == sorted(kept)
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    assert theirs.encode(PROMPT, add_special_tokens=False) == ids
    assert theirs.eos_token == "<|endoftext|>"
    exported = _generated(root, export)  # the export's own files, no --tokenizer either
    assert exported["prompt_ids"] == ids and exported["ids"] == record["ids"]


def test_the_run_keeps_its_tokenizer_for_d9d_export_and_a_lora_merged_export(moved):
    root, ids = moved
    transformers = pytest.importorskip("transformers")
    prepared = root / "lora-data"
    shutil.copytree(root / "data" / "prepared", prepared)
    lora = r"peft.lora={rank: 4, alpha: 8, target_modules: ['.*\.(q_proj|v_proj)']}"
    _train(root / "job", root / "runs", "lora", f"dataset={{path: {prepared}, seq_len: 32}}", lora,
           "export.lora=both", f"export.dir={root / 'lora-export'}")  # fmt: skip
    merged, adapter = root / "lora-export" / "merged", root / "lora-export" / "adapter"
    assert (merged / "tokenizer.json").is_file() and (merged / "tokenizer_config.json").is_file()
    assert not (adapter / "tokenizer.json").exists()  # adapters name their base, whose tokenizer they use
    # the data's tokenizer gone (a folder prepared before the copy, its tokenizer deleted since): `d9d
    # export` of the run takes the run's own copy
    shutil.rmtree(prepared / "tokenizer")
    index = json.loads((prepared / "index.json").read_text(encoding="utf-8"))
    (prepared / "index.json").write_text(json.dumps({**index, "tokenizer_folder": ""}), encoding="utf-8")
    output = _d9d(root, "export", str(root / "runs" / "lora"), "--out", str(root / "again"))
    assert "prepared data: no tokenizer for d9d generate and exports" in output
    theirs = transformers.AutoTokenizer.from_pretrained(root / "again" / "merged")
    assert theirs.encode(PROMPT, add_special_tokens=False) == ids
    copy = tokenizer_files_at(root / "runs" / "lora" / "tokenizer")
    assert tokenizer_digest(tokenizer_files_at(root / "again" / "merged")) == tokenizer_digest(copy)
