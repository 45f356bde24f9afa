"""Local slices of DTensor placements, checked against torch's own offset computation."""

import itertools

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from d9d.ckpt import SafetensorsIOError
from d9d.ckpt.io._placement import local_slices

CASES = [
    ((11, 4), (2,), (Shard(0),)),
    ((3, 7), (4,), (Shard(1),)),
    ((10, 6), (2, 3), (Shard(0), Shard(1))),
    ((13, 5), (2, 2), (Replicate(), Shard(0))),
    ((13, 5), (3, 2), (Shard(0), Shard(0))),
    ((1,), (4,), (Shard(0),)),
    ((5, 2), (2, 2), (Replicate(), Replicate())),
]


@pytest.mark.parametrize(("shape", "mesh", "placements"), CASES)
def test_local_slices_match_torch(shape, mesh, placements):
    for coord in itertools.product(*(range(n) for n in mesh)):
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        slices = local_slices(shape, mesh, coord, placements)
        assert tuple(s.stop - s.start for s in slices) == tuple(local_shape), coord
        for s, size, off in zip(slices, local_shape, offset, strict=True):
            if size:
                assert s.start == off, coord


def test_partial_placement_is_refused_with_a_hint():
    with pytest.raises(SafetensorsIOError, match=r"Partial.*only Shard and Replicate"):
        local_slices((4,), (2,), (0,), (Partial(),))
