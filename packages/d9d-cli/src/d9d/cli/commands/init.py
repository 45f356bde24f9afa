"""`d9d init`: write a ready-to-run job into a directory: a small Llama-style model trained on a corpus
(train.py, config.yaml, corpus.txt), or a LoRA fine-tune of a Hugging Face folder (config.yaml alone,
and sample conversations when no data is given)."""

import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import click

from d9d.cli.errors import CliError, reports_errors

__all__ = [
    "TEMPLATE_FILES",
    "d9d_invocation",
    "finetune_config",
    "init",
    "write_finetune",
    "write_quickstart",
]

#: Files `d9d init` writes by default, shipped as package data in `d9d/cli/templates/`.
TEMPLATE_FILES = ("train.py", "config.yaml", "corpus.txt")
#: What a chat file holds per line, and what `--data` may be.
_CHAT_SUFFIXES, _TEXT_SUFFIXES = (".jsonl",), (".txt",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _check_targets(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """The files to write into `directory`, once none exists and the directory can hold them."""
    targets = [directory / name for name in names]
    existing = [str(t) for t in targets if t.exists()]
    if existing:
        raise CliError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
            "d9d init never overwrites files: choose another directory or move them away"
        )
    if directory.exists() and not directory.is_dir():
        raise CliError(f"{directory} is a file, not a directory")
    return targets


def write_quickstart(directory: Path) -> list[Path]:
    """Write the quickstart files into `directory` (created if needed); never overwrites a file.

    Raises:
        CliError: when any of the files already exists (then nothing is written).
    """
    targets = _check_targets(directory, TEMPLATE_FILES)
    directory.mkdir(parents=True, exist_ok=True)
    templates = resources.files("d9d.cli").joinpath("templates")
    for target in targets:
        target.write_bytes(templates.joinpath(target.name).read_bytes())
    return targets


def write_finetune(directory: Path, folder: Path, data: Path | None) -> list[Path]:
    """Write a LoRA fine-tune of the Hugging Face `folder` into `directory`: config.yaml, and
    chat.jsonl (conversations made from the quickstart corpus) when no `data` is given.

    Raises:
        CliError: the folder has no config.json, chat data without the folder's tokenizer, data of
            another kind, or a file that would be overwritten (then nothing is written).
    """
    if not (folder / "config.json").is_file():
        raise CliError(f"--from {folder}: no config.json there; pass a Hugging Face model folder")
    has_tokenizer = any((folder / name).is_file() for name in _TOKENIZER_FILES)
    if data is not None and not data.is_file():
        raise CliError(f"--data {data}: no such file; pass a .jsonl of conversations or a .txt file")
    if data is not None and data.suffix not in _CHAT_SUFFIXES + _TEXT_SUFFIXES:
        raise CliError(
            f"--data {data}: a .jsonl of conversations or a .txt file, got {data.suffix or 'no suffix'}"
        )
    chat = data is None or data.suffix in _CHAT_SUFFIXES
    if chat and not has_tokenizer:
        raise CliError(
            f"--from {folder}: no tokenizer.json or tokenizer_config.json there, which conversations are "
            "tokenized with; use the model's folder with its tokenizer, or --data a .txt file"
        )
    targets = _check_targets(
        directory, ("config.yaml",) if data is not None else ("config.yaml", "chat.jsonl")
    )
    directory.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = targets[1]
        data.write_text(_sample_conversations(), encoding="utf-8")
    text = finetune_config(_relative(folder, directory), _relative(data, directory), chat=chat,
                           tokenizer=has_tokenizer)  # fmt: skip
    targets[0].write_text(text, encoding="utf-8")
    return targets


def finetune_config(folder: str, data: str, *, chat: bool, tokenizer: bool) -> str:
    """The config.yaml of a LoRA fine-tune of `folder` on `data` (paths as the config writes them)."""
    provider = "ChatDatasetProvider" if chat else "TextDatasetProvider"
    dataset = f"  path: {json.dumps(data)}\n"
    dataset += f"  tokenizer: {json.dumps(folder)}   # the model's own tokenizer\n" if tokenizer else ""
    dataset += "  seq_len: 512\n" + (
        "  pack: true                # conversations share rows, never attending to each other\n"
        if chat
        else ""
    )
    return f"""# A LoRA fine-tune of a Hugging Face folder (written by `d9d init --template finetune`): a config file
# alone, built-in providers only. Exports the adapter (PEFT's layout) and the merged model.
providers:
  model: d9d.trainer:HFModelProvider
  dataset: d9d.trainer:{provider}
mesh:
  data_parallel_shard: 1      # e.g. 8 under torchrun --nproc-per-node 8
model:
  hf_folder: {json.dumps(folder)}   # config.json + safetensors, relative to this file
  backend: auto               # d9d's model for llama, qwen2, qwen3, mistral, mixtral; else transformers'
dataset:
{dataset}data:
  global_batch_size: 8
  microbatch_size: 2
peft:
  lora:
    rank: 8
    alpha: 16
    dropout: 0.0
    target_modules: ['.*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)']
trainer:
  run:
    name: finetune
  schedule:
    total_steps: 100
  checkpointing:
    save_dir: runs
    period_steps: 50
    num_to_keep: 2
  logging:
    period_steps: 10
optimizer: {{name: adamw, lr: 2.0e-4, weight_decay: 0.0}}
lr_scheduler: {{name: cosine, warmup_steps: 10}}
export:
  dir: export                 # export/adapter (PEFT) and export/merged (Hugging Face)
  lora: both
"""


def _relative(path: Path, directory: Path) -> str:
    """`path` as the config in `directory` names it: relative when it lies below that directory."""
    absolute, base = path.resolve(), directory.resolve()
    return str(absolute.relative_to(base)) if absolute.is_relative_to(base) else str(absolute)


def _sample_conversations(count: int = 240) -> str:
    """Conversations to start from, made from the quickstart corpus: the user gives a sentence, the
    assistant answers with the next (replace them with your own)."""
    corpus = resources.files("d9d.cli").joinpath("templates", "corpus.txt").read_text(encoding="utf-8")
    pieces = (" ".join(s.split()) for s in re.split(r"(?<=[.;:?!])\s+", corpus))
    sentences = [s for s in pieces if 20 <= len(s) <= 160]
    lines = []
    for i in range(0, min(len(sentences) - 1, 2 * count), 2):
        messages = [
            {"role": "user", "content": f"What comes after: {sentences[i]}"},
            {"role": "assistant", "content": sentences[i + 1]},
        ]
        lines.append(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return "".join(lines)


def d9d_invocation(environ: Mapping[str, str] | None = None) -> str:
    """How the user's shell runs this same `d9d`: `d9d` when that is the one on its PATH, else a full path.

    Under `uv run` (or from a virtual environment that is not activated) the shell that typed the
    command lacks this environment's `bin` directory on its PATH, so a bare `d9d` would fail or run
    another installation; the path of this environment's `d9d` script works from any directory.
    """
    env = os.environ if environ is None else environ
    script = Path(sys.executable).parent / ("d9d.exe" if os.name == "nt" else "d9d")
    if not script.is_file():  # d9d.cli run from a checkout, not installed as a script
        return f"{shlex.quote(sys.executable)} -m d9d.cli"
    if "UV_RUN_RECURSION_DEPTH" not in env:  # uv run puts the environment on PATH for its child only
        found = shutil.which("d9d", path=env.get("PATH"))
        if found is not None and os.path.samefile(found, script):
            return "d9d"
    return shlex.quote(str(script))


@click.command(short_help="Write a ready-to-run job: a small model, or a fine-tune of a folder.")
@click.argument("directory", type=click.Path(), default=".")
@click.option(
    "--template",
    type=click.Choice(["quickstart", "finetune"]),
    default="quickstart",
    show_default=True,
    help="quickstart: a small Llama-style model trained on a corpus (train.py, config.yaml, corpus.txt); "
    "finetune: LoRA on the Hugging Face folder --from (config.yaml alone).",
)
@click.option(
    "--from", "source", type=click.Path(), help="The Hugging Face folder to fine-tune (--template finetune)."
)
@click.option(
    "--data",
    type=click.Path(),
    help="Conversations (.jsonl) or text (.txt) to fine-tune on; default: sample conversations in chat.jsonl.",
)
@reports_errors
def init(directory: str, template: str, source: str | None, data: str | None) -> None:
    """Write a ready-to-run job into DIRECTORY (default: the current one); never overwrites a file.

    The quickstart writes train.py (its model and dataset providers, yours to edit), config.yaml (the
    job) and corpus.txt (public-domain text to train on). Its model is d9d's Llama-style decoder
    (d9d.trainer.models): the export is a Hugging Face folder transformers loads. The fine-tune writes
    config.yaml naming built-in providers only: LoRA adapters on the folder --from, trained on --data.

    \b
    Examples:
      d9d init my-job
      cd my-job && d9d train config.yaml
      d9d plan my-job/config.yaml --world-size 4 --set mesh.data_parallel_shard=4
      d9d init my-ft --template finetune --from path/to/Qwen3-0.6B --data chats.jsonl
    """
    target = Path(directory)
    if template == "finetune":
        if source is None:
            raise CliError("--template finetune needs --from: the Hugging Face folder to fine-tune")
        written = write_finetune(target, Path(source), Path(data) if data is not None else None)
    elif source is not None or data is not None:
        raise CliError("--from and --data are options of --template finetune; add --template finetune")
    else:
        written = write_quickstart(target)
    click.echo("wrote " + ", ".join(str(p) for p in written))
    d9d = d9d_invocation()
    cd = "" if target.resolve() == Path.cwd().resolve() else f"cd {shlex.quote(str(target))} && "
    click.echo(
        f"next, train it (one process{', a few minutes on a CPU' if template == 'quickstart' else ''}):"
    )
    click.echo(f"  {cd}{d9d} train config.yaml")
    click.echo("or check it for 2 processes first (no GPUs needed):")
    click.echo(f"  {cd}{d9d} plan config.yaml --world-size 2 --set mesh.data_parallel_shard=2")
