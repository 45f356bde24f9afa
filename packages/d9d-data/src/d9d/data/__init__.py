"""d9d.data: not implemented yet (see packages/d9d-data/README.md)."""

__all__: list[str] = []
