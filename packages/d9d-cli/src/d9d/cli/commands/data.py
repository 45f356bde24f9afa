"""`d9d data prepare`: tokenize a corpus once into the token shards and index a config's
`dataset: {path: DIR}` reads (`d9d.data.prepare_dataset`)."""

import click

from d9d.cli.errors import reports_errors

__all__ = ["data"]


@click.group(short_help="Prepare a corpus for training: tokenize it once into shards.")
def data() -> None:
    """Prepare datasets for training.

    \b
    Examples:
      d9d data prepare corpus/ --out prepared/ --workers 4
      d9d data prepare --help
    """


@data.command(short_help="Tokenize text, JSONL and Parquet sources into a prepared folder.")
@click.argument("sources", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(), help="The prepared folder to write.")
@click.option(
    "--tokenizer",
    type=click.Path(),
    default=None,
    help="A Hugging Face tokenizer folder (or tokenizer.json), copied into --out; default: the built-in "
    "byte tokenizer.",
)
@click.option(
    "--text-key",
    default="text",
    show_default=True,
    help="The JSONL key or Parquet column that holds a document's text.",
)
@click.option(
    "--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Tokenizing processes."
)
@click.option(
    "--dtype",
    type=click.Choice(["uint16", "uint32"]),
    default=None,
    help="Token id width; default: the smallest that holds the vocabulary.",
)
@reports_errors
def prepare(
    sources: tuple[str, ...], out: str, tokenizer: str | None, text_key: str, workers: int, dtype: str | None
) -> None:
    """Tokenize SOURCES (files or folders of .txt, .jsonl, .jsonl.gz, .jsonl.zst and .parquet, searched
    recursively, and folders a Hugging Face `datasets` saved with save_to_disk) into --out: one token shard per source file, each document followed by the
    end-of-document token, a copy of the --tokenizer files (tokenizer/), and an index.json written last.
    The folder needs nothing outside it: it trains from any directory, moved or not, and the runs
    trained on it keep its tokenizer for `d9d generate` and exports.

    The output is the same bytes for any --workers. A prepare that is interrupted continues where it
    stopped when run again with the same arguments (finished shards are kept); one that is complete
    returns at once. Train on the folder with `dataset: {path: DIR, seq_len: L}` and the built-in
    `providers.dataset: d9d.trainer:PreparedDataProvider`.

    \b
    Examples:
      d9d data prepare corpus/ --out prepared/ --workers 4
      d9d data prepare dump/*.jsonl.gz --out prepared/ --tokenizer tokenizer/ --text-key content
    """
    from d9d.data import prepare_dataset

    prepare_dataset(list(sources), out, tokenizer=tokenizer, text_key=text_key, workers=workers, dtype=dtype)
