"""d9d.trainer: not implemented yet (see packages/d9d-trainer/README.md)."""

__all__: list[str] = []
