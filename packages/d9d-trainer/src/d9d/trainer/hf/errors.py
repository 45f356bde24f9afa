"""The Hugging Face backend's exception type: what a folder or an architecture cannot do, and the fix."""

from d9d.mesh import D9dError

__all__ = ["HFModelError"]


class HFModelError(D9dError, ValueError):
    """A Hugging Face model folder cannot be trained as asked (a missing config.json, weights that do not
    fit it, an architecture or a mesh degree the backend does not support); the message names the key
    or file and the fix."""
