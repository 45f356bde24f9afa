"""What every section of the job config is: a frozen msgspec struct that refuses unknown keys; and
`ConfigPath`, the type of a path in a provider's own section."""

from typing import NewType

import msgspec

__all__ = ["ConfigImport", "ConfigPath", "Section"]

#: A path in a provider's config section: declare a field `ConfigPath` (or `ConfigPath | None`) in
#: the provider's `config_type` and the provider receives it absolute, taken from the config file's
#: directory like every path of a job (`LoadedJob.resolve_path`), so it can read the file at once.
ConfigPath = NewType("ConfigPath", str)

#: An object to import in a provider's config section, `package.module:Name` or `file.py:Name`: declare
#: a field `ConfigImport` and a file it names arrives absolute (from the config file's directory, like
#: a `ConfigPath`), so the provider can import it with `d9d.trainer.job.resolve.resolve_object` at once.
ConfigImport = NewType("ConfigImport", str)


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: immutable, unknown keys rejected."""
