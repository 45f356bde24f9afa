"""`d9d generate` on a trained quickstart run, each command in a process of its own (forked): greedy text equals transformers'
`generate` on the run's export, with d9d's KV cache, transformers' cache and a plain re-forward; one
seed gives the same sampled text, another seed other text; bad requests are one line, exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import TINY, run_cli, train

STEPS = 40
PROMPT = "Call me Ishmael. Some years ago"
NEW = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 40-step tiny quickstart run (checkpoints at 20 and 40, lr high enough for the text to depend on
    the prompt) and its export."""
    root = tmp_path_factory.mktemp("generate")
    export = root / "export"
    train(1, [*TINY, f"trainer.checkpointing.save_dir={root / 'runs'}", "trainer.run.name=gen",
              f"trainer.schedule.total_steps={STEPS}", "trainer.checkpointing.period_steps=20",
              "optimizer.lr=0.01", f"export.dir={export}"])  # fmt: skip
    return root / "runs" / "gen", export


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    """`d9d generate ARGS`, forked from the test process (the command's own main, no start-up)."""
    return run_cli(["generate", *args])


def _records(*args: str) -> list[dict]:
    done = _generate(*args, "--format", "jsonl")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_greedy_text_equals_transformers_generate_on_the_export(trained):
    run_dir, export = trained
    transformers = pytest.importorskip("transformers")
    import torch

    (ours,) = _records(str(run_dir), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW))
    assert ours["method"] == "kv_cache" and ours["step"] == STEPS
    assert ours["prompt_ids"] == list(PROMPT.encode())  # the run's byte tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ours["prompt_ids"]]), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=256, pad_token_id=256)  # fmt: skip
    theirs = out[0, len(ours["prompt_ids"]) :].tolist()
    assert ours["ids"] == theirs
    assert len(set(theirs)) >= 4, theirs  # the model's text depends on where it is, not one token repeated
    # the export itself, loaded with transformers and run with its cache, writes the same text
    (exported,) = _records(str(export), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens",
                           str(NEW), "--tokenizer", "byte")  # fmt: skip
    assert exported["method"] == "hf_cache" and exported["ids"] == theirs
    assert exported["completion"] == ours["completion"] == bytes(theirs).decode("utf-8", errors="replace")


def test_a_seed_gives_the_same_text_and_another_seed_other_text(trained):
    run_dir, _ = trained
    sampling = ["--temperature", "1.0", "--top-k", "50", "--top-p", "0.95", "--max-new-tokens", "40"]
    first = _records(str(run_dir), "--prompt", PROMPT, "--prompt", "It was", *sampling, "--seed", "3")
    again = _records(str(run_dir), "--prompt", PROMPT, "--prompt", "It was", *sampling, "--seed", "3")
    other = _records(str(run_dir), "--prompt", PROMPT, "--prompt", "It was", *sampling, "--seed", "4")
    assert [r["ids"] for r in first] == [r["ids"] for r in again]
    assert [r["ids"] for r in first] != [r["ids"] for r in other]
    assert [r["prompt"] for r in first] == [PROMPT, "It was"]
    # an earlier checkpoint is other weights: other greedy text from the same prompt
    (latest,) = _records(str(run_dir), "--prompt", PROMPT, "--temperature", "0")
    (earlier,) = _records(str(run_dir), "--prompt", PROMPT, "--temperature", "0", "--step", "20")
    assert earlier["step"] == 20 and earlier["ids"] != latest["ids"]


def test_text_mode_prints_only_the_completions_and_prompts_come_from_a_file(trained, tmp_path):
    run_dir, _ = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n\nIt was\n", encoding="utf-8")
    args = [str(run_dir), "--prompt-file", str(prompts), "--temperature", "0", "--max-new-tokens", "8"]
    records = _records(*args)
    assert [r["prompt"] for r in records] == [PROMPT, "It was"]  # the blank line is skipped
    done = _generate(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(r["completion"] + "\n" for r in records)  # no log line on stdout


def test_bad_requests_are_one_line_with_exit_status_2(trained, tmp_path):
    run_dir, export = trained
    empty = tmp_path / "runs" / "empty"
    (empty / "save-2").mkdir(parents=True)  # an unfinished save: no committed checkpoint
    long_prompt = "x" * 5000  # the quickstart model takes 4096 positions
    cases = [
        ([str(empty), "--prompt", "a"], "has no committed checkpoint to generate from; train the job first"),
        ([str(run_dir), "--prompt", long_prompt], "the prompt has 5000 tokens; the model takes at most 4096"),
        ([str(run_dir), "--prompt", "a", "--max-new-tokens", "4096"], "generate at most 4095 new tokens"),
        ([str(run_dir)], "no prompt given; pass --prompt TEXT or --prompt-file FILE"),
        ([str(run_dir), "--prompt", "a", "--step", "5"], "has no committed checkpoint of step 5"),
        ([str(run_dir), "--prompt", "a", "--step", "3", "--best"], "pass one of them"),
        ([str(run_dir), "--prompt", "a", "--best"], "no checkpoint that records eval_loss"),
        ([str(run_dir), "--prompt", "a", "--chat"], "has no chat template; leave out --chat"),
        ([str(export), "--prompt", "a"], "the export has no tokenizer.json; pass --tokenizer"),
        ([str(export), "--prompt", "a", "--step", "3"], "is an export"),
        ([str(tmp_path / "nowhere"), "--prompt", "a"], "no such run directory or export folder"),
        ([str(run_dir), "--prompt", "a", "--tokenizer", str(tmp_path / "none")], "--tokenizer"),
    ]
    results = [_generate(*args) for args, _ in cases]  # forked one by one: no start-up to overlap
    for (args, expected), done in zip(cases, results, strict=True):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (args, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (
            args,
            done.stderr,
        )
        assert done.stdout == "", args
    assert sorted(p.name for p in empty.iterdir()) == ["save-2"]  # nothing written


def test_a_chat_run_renders_its_chat_template_and_equals_transformers_on_its_merged_export(finetune_example):
    """The fine-tune example (LoRA on a tiny Qwen3, conversations): the prompt goes through the run's
    tokenizer's chat template; the greedy text of the run's latest checkpoint (with its adapters, on the
    reference model's cache) equals transformers' `generate` on the merged export, which carries the
    run's tokenizer files (no --tokenizer for either)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from d9d.data import load_tokenizer

    example = finetune_example
    sets = ["trainer.schedule.total_steps=6", "trainer.checkpointing.period_steps=3", "eval.period_steps=3",
            "data.global_batch_size=8", "data.microbatch_size=2", "trainer.logging.progress_bar=false",
            "trainer.run.name=generate", "export.dir=export-generate", "optimizer.lr=0.05"]  # fmt: skip
    args = [arg for s in sets for arg in ("--set", s)]
    done = subprocess.run([sys.executable, "finetune.py", "config.yaml", *args], cwd=example, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    question = "What is the capital of France?"
    greedy = ["--prompt", question, "--temperature", "0", "--max-new-tokens", "12"]
    (ours,) = _records(str(example / "runs" / "generate"), *greedy)
    (best,) = _records(str(example / "runs" / "generate"), "--best", *greedy)
    tokenizer = load_tokenizer(example / "demo" / "model")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)  # type: ignore[attr-defined]
    assert ours["prompt_ids"] == list(chat) and ours["method"] == "kv_cache" and ours["step"] == 6
    assert best["prompt_ids"] == list(chat) and best["step"] in (3, 6)  # by its recorded eval_loss
    export = example / "export-generate" / "merged"
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([chat]), do_sample=False, max_new_tokens=12,
                             eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)  # fmt: skip
    theirs = out[0, len(chat) :].tolist()
    (exported,) = _records(str(export), *greedy)  # no --tokenizer: the export has the run's files
    assert exported["prompt_ids"] == list(chat) and exported["ids"] == theirs  # the export's own template use
    assert (example / "runs" / "generate" / "tokenizer" / "tokenizer_config.json").is_file()  # the run's copy
    assert ours["ids"] == theirs  # the export holds the last step's weights, merged
    assert ours["completion"] == tokenizer.decode(
        ours["ids"][:-1] if ours["finish"] == "stop" else ours["ids"]
    )
