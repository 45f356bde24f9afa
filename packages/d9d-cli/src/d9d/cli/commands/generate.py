"""`d9d generate`: sample text from a run's checkpoint (latest, a step or the best) or from an export.

From a run directory the job is rebuilt on one process from the config its checkpoint holds, as
`d9d export` rebuilds it (read-only: no run lock, nothing written), without compile, activation
checkpointing, CPU offload or float8 (none of them changes what the weights compute), and the run's
tokenizer encodes the prompts: the copy of its files in the run directory (`RUN_DIR/tokenizer`,
written with the first checkpoint), else the dataset's (the byte tokenizer has no files). An export
folder (config.json + safetensors) is loaded with transformers (the `hf` extra of d9d-trainer) and its
own tokenizer files, which `d9d export` writes beside the weights.

The generated text is the only thing on stdout (the job's build log is silenced unless --verbose);
`--format jsonl` prints one JSON object per prompt, with the token ids.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from d9d.cli.commands._options import overrides_option
from d9d.cli.commands._runs import check_run_dir
from d9d.cli.commands.export import committed_checkpoint, loaded_from_run, single_process_mesh, with_values
from d9d.cli.errors import CliError, reports_errors

if TYPE_CHECKING:  # torch and the trainer: only inside the command at run time
    import torch

    from d9d.data import Tokenizer
    from d9d.trainer import LoadedJob, SamplingConfig

__all__ = ["generate", "read_prompts"]

_HF_HINT = "uv sync --all-packages --extra hf (or pip install transformers)"


def read_prompts(prompts: Sequence[str], prompt_file: str | None) -> list[str]:
    """The prompts: each `--prompt`, then each non-blank line of `--prompt-file`; one is required."""
    found = list(prompts)
    if prompt_file is not None:
        path = Path(prompt_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--prompt-file {path}: cannot read it ({exc}); pass a UTF-8 text file") from exc
        found += [line for line in text.splitlines() if line.strip()]
    if not found:
        raise CliError("no prompt given; pass --prompt TEXT or --prompt-file FILE (one prompt per line)")
    if any(not prompt for prompt in found):
        raise CliError("a --prompt is empty; pass some text to continue")
    return found


def _is_export(folder: Path) -> bool:
    """A folder with a config.json and safetensors but no checkpoint (`save-<step>`) in it."""
    return (folder / "config.json").is_file() and not any(folder.glob("save-*"))


def _inference_values(loaded: "LoadedJob", verbose: bool) -> dict[str, Any]:
    """The settings turned off for generating (each only where the job had it on), and the log level."""
    tcfg = loaded.config.trainer
    values: dict[str, Any] = {}
    if tcfg.compile.enabled:
        values["trainer.compile.enabled"] = False
    if tcfg.activation_checkpointing.mode != "none":
        values["trainer.activation_checkpointing.mode"] = "none"
    if tcfg.memory.cpu_offload:
        values["trainer.memory.cpu_offload"] = False
    if tcfg.precision.float8 is not None:
        values["trainer.precision.float8"] = None
    if tcfg.logging.log_dir is not None:
        values["trainer.logging.log_dir"] = None
    if not verbose:
        values["trainer.logging.level"] = "ERROR"
    return values


def _tokenizer_from(spec: str) -> "Tokenizer":
    """`--tokenizer`: `byte`, a tokenizer folder or a tokenizer.json file."""
    from d9d.data import ByteTokenizer, load_tokenizer

    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).exists():
        raise CliError(
            f"--tokenizer {spec}: no such file or folder; pass a tokenizer folder, a tokenizer.json or byte"
        )
    return load_tokenizer(spec)


def _from_run(
    run_dir: Path, step: int | None, best: bool, overrides: list[str], verbose: bool
) -> tuple[Any, "Tokenizer | None", dict[str, Any]]:
    """The trainer (to close), its tokenizer and what was loaded, for a run directory's checkpoint."""
    info = committed_checkpoint(run_dir, step, best=best, purpose="generate from")
    loaded = single_process_mesh(loaded_from_run(run_dir, info, overrides))
    loaded = with_values(loaded, _inference_values(loaded, verbose))

    from d9d.trainer import Trainer

    trainer = Trainer.from_config(loaded, read_only=True)
    try:
        trainer.resume(info.step)
    except BaseException:
        trainer.close()
        raise
    return trainer, trainer.tokenizer, {"step": info.step, "checkpoint": str(info.path.resolve())}


def _from_export(folder: Path, verbose: bool) -> "torch.nn.Module":
    """The exported model, loaded with transformers in float32 (its progress bars only with `verbose`)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise CliError(
            f"{folder} is an export: loading it needs transformers ({_HF_HINT}); or generate from the run "
            "directory it was exported from"
        ) from exc
    import torch

    if not verbose:
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"{folder}: transformers cannot load this export ({first})") from exc
    return model


@click.command(short_help="Sample text from a run or an export.")
@click.argument("source", metavar="RUN_DIR_OR_EXPORT", type=click.Path())
@click.option("--prompt", "prompts", multiple=True, help="Text to continue (repeat for several prompts).")
@click.option(
    "--prompt-file", type=click.Path(dir_okay=False), help="A UTF-8 file of prompts, one per non-blank line."
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0: greedy."
)
@click.option("--top-k", type=click.IntRange(min=1), help="Sample among the K most likely tokens only.")
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="Sample among the most likely tokens whose probabilities add up to P.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling generator.")
@click.option("--step", type=click.IntRange(min=0), help="Checkpoint step of a run (default: the latest).")
@click.option("--best", is_flag=True, help="A run's best checkpoint by its recorded eval metric.")
@click.option(
    "--tokenizer",
    "tokenizer_spec",
    help="A tokenizer folder, tokenizer.json or `byte` (default: the run's own, an export's own files).",
)
@click.option(
    "--chat/--no-chat",
    default=None,
    help="Render each prompt as a user message with the tokenizer's chat template (default: when it has one).",
)
@click.option(
    "--format", "fmt", type=click.Choice(["text", "jsonl"]), default="text", show_default=True,
    help="text: each completion; jsonl: one object per prompt with the token ids.",
)  # fmt: skip
@click.option("--verbose", is_flag=True, help="Print the job's build log too.")
@overrides_option
@reports_errors
def generate(
    source: str, prompts: Sequence[str], prompt_file: str | None, max_new_tokens: int, temperature: float,
    top_k: int | None, top_p: float | None, seed: int, step: int | None, best: bool,
    tokenizer_spec: str | None, chat: bool | None, fmt: str, verbose: bool, overrides: Sequence[str],
) -> None:  # fmt: skip
    """Generate text from a run's checkpoint or from an export, on one process.

    RUN_DIR_OR_EXPORT is a run directory (save_dir/run.name: its latest checkpoint, or --step N or
    --best) or a folder `d9d export` wrote (loaded with transformers). Each prompt is continued by up
    to --max-new-tokens tokens, ending early at the tokenizer's end-of-document token. The reference
    model runs with a KV cache (the prompt once, then one token per forward), a Hugging Face model
    with its own cache, any other model re-runs the whole sequence per token. One --seed gives the
    same text every time; --temperature 0 is greedy.

    \b
    Examples:
      d9d generate runs/quickstart --prompt "Call me" --max-new-tokens 40
      d9d generate runs/quickstart --prompt "Call me" --temperature 0.8 --top-p 0.9 --seed 1
      d9d generate runs/finetune --best --prompt-file prompts.txt --format jsonl
      d9d generate exported/ --prompt "Call me" --tokenizer byte --temperature 0
    """
    _check_one_process(step, best)
    texts = read_prompts(prompts, prompt_file)
    src = Path(source)
    export = _is_checked_export(src, step, best, overrides)

    from d9d.trainer import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed)  # fmt: skip
    trainer = None
    try:
        tokenizer = _tokenizer_from(tokenizer_spec) if tokenizer_spec is not None else None
        if export:
            model, tokenizer, origin = _load_export(src, tokenizer, verbose)
        else:
            trainer, found, origin = _from_run(check_run_dir(src), step, best, list(overrides), verbose)
            model = trainer.model
            tokenizer = _required(tokenizer if tokenizer is not None else found, export=False)
        _print_samples(model, tokenizer, texts, sampling, chat=chat, fmt=fmt, origin=origin)
    finally:
        if trainer is not None:
            trainer.close()


def _check_one_process(step: int | None, best: bool) -> None:
    """Refuse a checkpoint picked twice, and a launch under torchrun."""
    if best and step is not None:
        raise CliError("--best and --step both pick the checkpoint to generate from; pass one of them")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise CliError("d9d generate runs on one process; run it without torchrun")


def _is_checked_export(src: Path, step: int | None, best: bool, overrides: Sequence[str]) -> bool:
    """Whether `src` is an export (else a run directory); options that only a run takes are refused."""
    if not src.is_dir():
        raise CliError(
            f"{src}: no such run directory or export folder; pass a run directory (save_dir/run.name, e.g. "
            "runs/quickstart) or a folder d9d export wrote"
        )
    export = _is_export(src)
    if export and (step is not None or best):
        raise CliError(f"{src} is an export (one set of weights): --step and --best pick a run's checkpoint")
    if export and overrides:
        raise CliError(f"{src} is an export: --set changes a run's job config; generate from the run instead")
    return export


def _load_export(
    src: Path, tokenizer: "Tokenizer | None", verbose: bool
) -> tuple["torch.nn.Module", "Tokenizer", dict[str, Any]]:
    """The export's model, the tokenizer (`--tokenizer`, else the export's own) and where they came from."""
    if tokenizer is None and (src / "tokenizer.json").is_file():
        tokenizer = _tokenizer_from(str(src))
    # refused before transformers loads anything
    tokenizer = _required(tokenizer, export=True)
    return _from_export(src, verbose), tokenizer, {"export": str(src.resolve())}


def _required(tokenizer: "Tokenizer | None", *, export: bool) -> "Tokenizer":
    """`tokenizer`, or an error that says where none was found and how to pass one."""
    if tokenizer is None:
        where = (
            "the export has no tokenizer.json"
            if export
            else "the run keeps no tokenizer (RUN_DIR/tokenizer) and its dataset names none"
        )
        raise CliError(
            f"{where}; pass --tokenizer FOLDER (or tokenizer.json, or byte for d9d's byte tokenizer)"
        )
    return tokenizer


def _print_samples(
    model: "torch.nn.Module",
    tokenizer: "Tokenizer",
    texts: list[str],
    sampling: "SamplingConfig",
    *,
    chat: bool | None,
    fmt: str,
    origin: dict[str, Any],
) -> None:
    """Continue each prompt; print its completion (text) or one JSON record (jsonl)."""
    from d9d.trainer import SamplingConfig
    from d9d.trainer import generate as sample

    template = getattr(tokenizer, "chat_template", None)
    if chat and template is None:
        raise CliError(f"--chat: the tokenizer {tokenizer.name} has no chat template; leave out --chat")
    use_chat = template is not None if chat is None else chat
    eos = tokenizer.eos_id
    sampling = SamplingConfig(**{**sampling.__dict__, "stop_ids": (eos,) if eos is not None else ()})
    for prompt in texts:
        prompt_ids = (
            tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
            if use_chat
            else tokenizer.encode(prompt)
        )
        prompt_ids = [int(i) for i in prompt_ids]
        result = sample(model, prompt_ids, sampling)
        text_ids = result.ids[:-1] if result.finish == "stop" else result.ids
        completion = tokenizer.decode(text_ids)
        if fmt == "jsonl":
            record = {"prompt": prompt, "completion": completion, "prompt_ids": prompt_ids,
                      "ids": result.ids, "finish": result.finish, "method": result.method, **origin}  # fmt: skip
            click.echo(json.dumps(record, ensure_ascii=False))
        else:
            click.echo(completion)
