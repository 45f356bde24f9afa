"""Streaming safetensors IO in the Hugging Face layout (sharded with an index, or one file).

Public names are exported from `d9d.ckpt`.
"""
