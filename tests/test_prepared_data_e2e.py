"""Pretraining data without a Python file: `d9d data prepare` then `providers.dataset:
d9d.trainer:PreparedDataProvider` with `dataset: {path, seq_len}` or a weighted `mixture`.

The quickstart corpus prepared by the CLI trains bit-identically to the quickstart's own text
dataset of the same file (the same tokens in the same samples); a mixture of two prepared folders
trains the same on one process and on FSDP 2, counting the tokens of each source in every record,
and rank 0 logs the mixture's shares. Bad `dataset:`
sections of the provider (a folder never prepared or unfinished, path and mixture both, a weight of
0, an unknown key) are cases of the bad-input corpus (tests/bad_input/cases.yaml)."""

import itertools

from _quickstart import ROOT, compare_runs, overrides, records, run_local, train
from click.testing import CliRunner

from d9d.cli import cli

PREPARED = ["providers.dataset=d9d.trainer:PreparedDataProvider"]


def _prepare(source, out, *args: str) -> None:
    result = CliRunner().invoke(cli, ["data", "prepare", str(source), "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("prepared 1 document, ")  # the summary line


def test_a_prepared_corpus_trains_bit_identically_to_the_text_dataset_of_the_same_file(tmp_path):
    _prepare(ROOT / "examples" / "data" / "corpus.txt", tmp_path / "prepared", "--workers", "2")
    text = train(1, overrides(tmp_path, "text", 3, "trainer.checkpointing.period_steps=3"))
    prepared = train(1, overrides(tmp_path, "prepared", 3, "trainer.checkpointing.period_steps=3", *PREPARED,
                                  f"dataset={{path: {tmp_path / 'prepared'}, seq_len: 32}}"))  # fmt: skip
    compare_runs(prepared, text, rel=0)


def test_a_mixture_trains_the_same_on_one_process_and_fsdp_2_and_logs_its_shares(tmp_path):
    _prepare(ROOT / "examples" / "data" / "corpus.txt", tmp_path / "corpus")
    _prepare(ROOT / "examples" / "data" / "passages.txt", tmp_path / "passages")
    mixture = (f"dataset={{seq_len: 32, mixture: [{{path: {tmp_path / 'corpus'}, weight: 3}}, "
               f"{{path: {tmp_path / 'passages'}, weight: 1, name: passages}}]}}")  # fmt: skip
    args = [*PREPARED, mixture, "trainer.checkpointing.period_steps=3"]
    one = train(1, overrides(tmp_path, "one", 3, *args))
    fsdp = train(2, overrides(tmp_path, "fsdp", 3, "mesh.data_parallel_shard=2", *args))
    compare_runs(fsdp, one, rel=1e-5)
    # every record counts the tokens each source gave so far: the same on both meshes, 16 × 32 per step
    names = [f"tokens_seen/{n}" for n in (str(tmp_path / "corpus"), "passages")]
    for run in (one, fsdp):
        assert [sum(r[n] for n in names) for r in run.records] == [16 * 32 * s for s in (1, 2, 3)]
    assert [[r[n] for n in names] for r in fsdp.records] == [[r[n] for n in names] for r in one.records]
    done = run_local(overrides(tmp_path, "logged", 1, *args))
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if "prepared data mixture" in line]
    assert "passages" in line and "0.75" in line and "0.25" in line, line


def test_a_mixture_changed_on_resume_applies_its_new_shares_and_a_used_up_source_ends_the_run(tmp_path):
    _prepare(ROOT / "examples" / "data" / "corpus.txt", tmp_path / "corpus")
    _prepare(ROOT / "examples" / "data" / "passages.txt", tmp_path / "passages")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a small source. " * 80, encoding="utf-8")  # 1281 tokens with EOS: 40 samples of 32 (+1)
    _prepare(tiny, tmp_path / "tiny")

    def mixture(*parts: str, exhausted: str = "repeat") -> str:
        return f"dataset={{seq_len: 32, exhausted: {exhausted}, mixture: [{', '.join(parts)}]}}"

    def source(name: str, weight: int) -> str:
        return f"{{path: {tmp_path / name}, weight: {weight}, name: {name}}}"

    first = run_local(
        overrides(tmp_path, "run", 3, *PREPARED, mixture(source("corpus", 3), source("passages", 1)))
    )
    assert first.returncode == 0, first.stderr[-2000:]
    # resumed with new weights: passages out, tiny in at half the samples, and tiny is used up after
    # 80 samples (5 steps of 16), which ends the run before its 20 steps, with a checkpoint
    args = [*PREPARED, mixture(source("corpus", 1), source("tiny", 1), exhausted="stop")]
    second = run_local(overrides(tmp_path, "run", 20, *args))
    assert second.returncode == 0, second.stderr[-2000:]
    (changed,) = [line for line in second.stdout.splitlines() if "data mixture changed" in line]
    assert "passages: 0.2500 -> 0.0000" in changed and "tiny: 0.0000 -> 0.5000" in changed, changed
    assert "the data is used up after step 8 of 20" in second.stdout
    run = records(tmp_path / "run")
    assert [r["step"] for r in run] == list(range(1, 9))
    assert (tmp_path / "run" / "save-8").is_dir()
    # tokens seen per source: a source no longer mixed keeps its count, one added starts at 0
    seen = [[r.get(f"tokens_seen/{n}", 0) for n in ("corpus", "passages", "tiny")] for r in run]
    per_step = [[b - a for a, b in zip(x, y, strict=True)] for x, y in itertools.pairwise(seen)]
    assert per_step[:2] == [[12 * 32, 4 * 32, 0]] * 2  # 3:1 before the resume
    assert per_step[2:] == [[8 * 32, 0, 8 * 32]] * 5  # 1:1 of corpus and tiny after it
    again = run_local(overrides(tmp_path, "run", 20, *args))
    assert again.returncode == 0 and "no step left to train" in again.stdout, again.stderr[-2000:]
