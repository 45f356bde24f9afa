"""State mappers: small transforms between key spaces (our module names ↔ Hugging Face names).

    from d9d.ckpt import Chunk, Parallel, RopePermute, Sequential, rename_pattern

A mapper declares its groups (input keys → output keys) when built, so IO streams group by group;
`inverse()` undoes it where the transform is invertible (load an HF folder with the export mapper's
inverse). Public names are exported from `d9d.ckpt`.
"""
