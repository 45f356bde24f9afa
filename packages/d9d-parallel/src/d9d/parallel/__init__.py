"""d9d.parallel: not implemented yet (see packages/d9d-parallel/README.md)."""

__all__: list[str] = []
