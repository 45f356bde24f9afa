"""The table of `d9d`'s commands and group options, and the group help page laid out from it.

Neither click nor any command module is imported here: the entry point (`d9d.cli.main`) prints
`group_help()` for `d9d --help` on its own, and the click group (`d9d.cli._group`) serves its commands,
options and help page from the same table.
"""

__all__ = ["COMMANDS", "OPTIONS", "group_help"]

#: Every command, in the order `d9d --help` lists them, with its one-line help (the `short_help` of the
#: command in `d9d.cli.commands.<name>`; a test keeps the two equal).
COMMANDS: dict[str, str] = {
    "init": "Write a ready-to-run job: a small model, or a fine-tune of a folder.",
    "plan": "Validate a config for a launch size, without GPUs.",
    "preflight": "Check the nodes, links and save_dir before a launch.",
    "train": "Run a job (one process or under torchrun).",
    "checkpoints": "List a run's checkpoints; flag unfinished ones.",
    "metrics": "Summarize (and plot) a run's metrics; several runs to compare them.",
    "export": "Export a checkpoint as safetensors.",
    "generate": "Sample text from a run or an export.",
    "data": "Prepare a corpus for training: tokenize it once into shards.",
}

#: The group's own options and their help, as `d9d.cli._group` declares them.
OPTIONS: dict[str, str] = {
    "--version": "Print the version of every installed d9d package and exit.",
    "--debug": "Show full tracebacks instead of one-line errors.",
    "-h, --help": "Show this message and exit.",
}

_DESCRIPTION = """\
d9d: composable distributed training for PyTorch.

Examples:
  d9d init my-job && cd my-job         # a ready-to-run quickstart
  d9d plan config.yaml --world-size 8 --set mesh.data_parallel_shard=8
  torchrun --nproc-per-node 8 -m d9d.cli preflight config.yaml --set mesh.data_parallel_shard=8
  d9d train config.yaml --set trainer.schedule.total_steps=400
  torchrun --nproc-per-node 4 -m d9d.cli train config.yaml --set mesh.data_parallel_shard=4
  d9d checkpoints runs/quickstart
  d9d metrics runs/quickstart
  d9d export runs/quickstart --out exported/
  d9d generate runs/quickstart --prompt "Call me" --max-new-tokens 40
  d9d data prepare corpus/ --out prepared/ --workers 4"""


def _rows(table: dict[str, str]) -> list[str]:
    width = max(len(name) for name in table)
    return [f"  {name.ljust(width)}  {text}" for name, text in table.items()]


def group_help() -> str:
    """The text of `d9d --help` (laid out as click lays out a group's help page)."""
    description = ["  " + line if line else "" for line in _DESCRIPTION.splitlines()]
    lines = [
        "Usage: d9d [OPTIONS] COMMAND [ARGS]...",
        "",
        *description,
        "",
        "Options:",
        *_rows(OPTIONS),
        "",
        "Commands:",
        *_rows(COMMANDS),
    ]
    return "\n".join(lines) + "\n"
