"""d9d.ckpt: not implemented yet (see packages/d9d-ckpt/README.md)."""

__all__: list[str] = []
