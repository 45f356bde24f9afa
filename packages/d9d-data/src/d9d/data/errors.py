"""Exception types of d9d.data: every message says what was wrong and how to fix it."""

from d9d.mesh import D9dError

__all__ = [
    "BatchSizeError",
    "DataConfigError",
    "DataError",
    "DataStateError",
    "DatasetError",
    "TokenizerError",
]


class DataError(D9dError):
    """Base class of every error d9d.data raises on purpose."""


class DataConfigError(DataError, ValueError):
    """A `data:` config value is invalid (a size below 1, a negative worker count, ...)."""


class BatchSizeError(DataConfigError):
    """global_batch_size is not divisible by data-parallel ranks × microbatch_size."""


class DatasetError(DataError, ValueError):
    """A dataset cannot serve the job: too small for one global batch, a malformed token file, ..."""


class DataStateError(DataError, ValueError):
    """A saved data state does not fit this run (other dataset or seed, missing keys, bad values)."""


class TokenizerError(DataError, RuntimeError):
    """A tokenizer cannot be loaded or used (missing file, `tokenizers` not installed, ...)."""
