import itertools

import numpy as np
import pytest

from d9d.mesh import (
    DOMAINS,
    MeshConfig,
    axis_groups,
    domain_layout,
    format_layout,
    rank_coordinates,
    rank_tag,
)

CONFIGS = [
    MeshConfig(),
    MeshConfig(data_parallel_shard=4),
    MeshConfig(data_parallel_replicate=2, data_parallel_shard=2, expert_parallel=2),
    MeshConfig(pipeline_parallel=2, data_parallel_shard=2, tensor_parallel=2, expert_parallel=4),
    MeshConfig(pipeline_parallel=3, data_parallel_replicate=2, context_parallel=2, tensor_parallel=2),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe_degrees())
def test_every_domain_covers_every_rank_once(config):
    for domain in DOMAINS:
        layout = domain_layout(config, domain)
        assert int(np.prod(layout.sizes)) == config.world_size
        assert sorted(layout.grid.reshape(-1).tolist()) == list(range(config.world_size))
        for axis in layout.axes:
            groups = axis_groups(config, domain, axis)
            assert all(len(g) == layout.size(axis) for g in groups)
            assert sorted(itertools.chain.from_iterable(groups)) == list(range(config.world_size))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe_degrees())
def test_coordinates_agree_with_groups(config):
    for domain, axes in DOMAINS.items():
        for axis in axes:
            for group in axis_groups(config, domain, axis):
                coords = [rank_coordinates(config, r)[domain] for r in group]
                # members of one group differ only on `axis`, and their coordinate there is their index
                assert [c[axis] for c in coords] == list(range(len(group)))
                others = {tuple(v for a, v in c.items() if a != axis) for c in coords}
                assert len(others) == 1


def test_domains_agree_on_shared_axes():
    config = MeshConfig(
        pipeline_parallel=2, data_parallel_replicate=2, data_parallel_shard=2, tensor_parallel=2
    )
    for rank in range(config.world_size):
        c = rank_coordinates(config, rank)
        assert c["dense"]["pp"] == c["expert"]["pp"] == c["batch"]["pp"]
        assert c["dense"]["tp"] == c["batch"]["tp"]
        assert c["batch"]["dp"] == c["dense"]["dp_replicate"] * 2 + c["dense"]["dp_shard"]
        assert c["world"]["world"] == rank


def test_expert_domain_regroups_innermost_ranks():
    config = MeshConfig(data_parallel_shard=4, expert_parallel=2)
    assert axis_groups(config, "expert", "ep_shard") == [[0, 1], [2, 3]]
    assert axis_groups(config, "expert", "ep_replicate") == [[0, 2], [1, 3]]


def test_tensor_parallel_peers_are_neighbours():
    config = MeshConfig(data_parallel_shard=2, tensor_parallel=4)
    assert axis_groups(config, "dense", "tp")[1] == [4, 5, 6, 7]
    assert axis_groups(config, "dense", "dp_shard")[0] == [0, 4]


def test_rank_tag_and_errors():
    config = MeshConfig(data_parallel_shard=2, tensor_parallel=2, expert_parallel=2)
    assert rank_tag(config, 3) == "rank 3 dps1 tp1 ep1"
    with pytest.raises(ValueError, match="rank 4 is outside a mesh of 4 ranks"):
        rank_coordinates(config, 4)
    with pytest.raises(KeyError, match="unknown mesh domain 'sparse'"):
        domain_layout(config, "sparse")
    with pytest.raises(KeyError, match="has no axis 'tp'"):
        domain_layout(config, "expert").size("tp")


def test_format_layout_lists_groups():
    text = format_layout(MeshConfig(data_parallel_shard=2, tensor_parallel=2))
    assert "world size 4" in text
    assert "tp            size 2     groups: [0,1], [2,3]" in text
    assert "dp_shard      size 2     groups: [0,2], [1,3]" in text
