"""Streaming safetensors IO in the Hugging Face layout (sharded with an index, or one file).

Public names are exported from `d9d.ckpt`.
"""

from d9d.ckpt.io._errors import SafetensorsIOError
from d9d.ckpt.io._fingerprint import safetensors_fingerprint
from d9d.ckpt.io._read import check_safetensors, load_safetensors, safetensors_shapes
from d9d.ckpt.io._write import save_safetensors

__all__ = [
    "SafetensorsIOError",
    "check_safetensors",
    "load_safetensors",
    "safetensors_fingerprint",
    "safetensors_shapes",
    "save_safetensors",
]
