"""Datasets for language models that need no downloads (public names are exported by `d9d.data`)."""
