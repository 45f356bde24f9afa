"""The run's tokenizer: the one its dataset was encoded with (`BuildDatasetResult.tokenizer`), and a
copy of its files in the run directory (`RUN_TOKENIZER_DIR`), written with the run's first checkpoint
(and again should a resumed run train with another tokenizer). Read back (`d9d generate`, `d9d export`:
a read-only Trainer), the copy is the tokenizer: the run stays complete when the tokenizer's source
moves or changes. The built-in byte tokenizer has no files: nothing is copied, the dataset gives it."""

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

from d9d.data import (
    Tokenizer,
    copy_tokenizer_files,
    load_tokenizer,
    tokenizer_digest,
    tokenizer_files,
    tokenizer_files_at,
)
from d9d.mesh import get_logger

__all__ = ["RUN_TOKENIZER_DIR", "RunTokenizer"]

#: The folder of the run directory that holds the copy of the run's tokenizer files.
RUN_TOKENIZER_DIR = "tokenizer"

_log = get_logger("d9d.trainer")


class RunTokenizer:
    """One run's tokenizer and its copy in the run directory.

    Args:
        run_dir: `save_dir/run.name`.
        dataset_tokenizer: the tokenizer the dataset provider gave (None: it named none).
        read_only: the run is read back (its copy is the tokenizer), not trained (the copy is written).
        is_main_process: this process writes the copy (rank 0).
    """

    def __init__(
        self, run_dir: Path, dataset_tokenizer: Tokenizer | None, *, read_only: bool, is_main_process: bool
    ) -> None:
        self.folder = Path(run_dir) / RUN_TOKENIZER_DIR
        self._dataset_tokenizer = dataset_tokenizer
        self._read_only = read_only
        self._writes = is_main_process and not read_only
        self._recorded = False

    def _kept(self) -> dict[str, Path]:
        """The copy in the run directory, when the run is read back and has one."""
        return tokenizer_files_at(self.folder) if self._read_only else {}

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The copy's tokenizer when the run is read back and has one, else the dataset's (None: no
        tokenizer is known); loaded once, on first use."""
        return load_tokenizer(self.folder) if self._kept() else self._dataset_tokenizer

    def files(self) -> Mapping[str, Path]:
        """The tokenizer's files (what an export carries): the copy's, else the dataset tokenizer's;
        empty for a tokenizer without files (byte-level)."""
        return self._kept() or tokenizer_files(self._dataset_tokenizer)

    def record(self) -> None:
        """Copy the dataset tokenizer's files into the run directory (on the writing process, once per
        job, and only when the copy there differs: a resumed run that trains with another tokenizer
        says so)."""
        if not self._writes or self._recorded:
            return
        self._recorded = True
        files = tokenizer_files(self._dataset_tokenizer)
        if not files:
            return
        kept = tokenizer_files_at(self.folder)
        if kept and tokenizer_digest(kept) == tokenizer_digest(files):
            return
        if kept:
            _log.warning(
                "the run trains with another tokenizer than its earlier checkpoints; the run's copy is "
                "replaced", run_copy=str(self.folder), now=str(files["tokenizer.json"]),
            )  # fmt: skip
        copy_tokenizer_files(files, self.folder)
