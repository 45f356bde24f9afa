"""State mappers: small transforms between key spaces (our module names ↔ Hugging Face names).

    from d9d.ckpt.mapper import Chunk, Parallel, RopePermute, Sequential, rename_pattern

A mapper declares its groups (input keys → output keys) when built, so IO streams group by group;
`inverse()` undoes it where the transform is invertible (load an HF folder with the export mapper's
inverse). Public names are also exported from `d9d.ckpt`.
"""

from d9d.ckpt.mapper._base import MappingGroup, StateMapper
from d9d.ckpt.mapper._check import OnUnused, apply_mapper, check_mapper
from d9d.ckpt.mapper._compose import Parallel, Prefix, SelectOutputs, Sequential
from d9d.ckpt.mapper._errors import MappingError, NotInvertibleError, UnusedKeysWarning
from d9d.ckpt.mapper._rename import (
    Deduplicate,
    Drop,
    Duplicate,
    Identity,
    Rename,
    identity_map,
    rename_pattern,
)
from d9d.ckpt.mapper._split import Chunk, Concat, Stack, Unstack
from d9d.ckpt.mapper._tensor import Cast, Reshape, RopePermute, Transpose

__all__ = [
    "Cast",
    "Chunk",
    "Concat",
    "Deduplicate",
    "Drop",
    "Duplicate",
    "Identity",
    "MappingError",
    "MappingGroup",
    "NotInvertibleError",
    "OnUnused",
    "Parallel",
    "Prefix",
    "Rename",
    "Reshape",
    "RopePermute",
    "SelectOutputs",
    "Sequential",
    "Stack",
    "StateMapper",
    "Transpose",
    "Unstack",
    "UnusedKeysWarning",
    "apply_mapper",
    "check_mapper",
    "identity_map",
    "rename_pattern",
]
