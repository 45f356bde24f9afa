"""The HF layout arithmetic: sizes, file names, shard planning."""

import itertools

import pytest

from d9d.ckpt import SafetensorsIOError
from d9d.ckpt.io._layout import is_layout_file, parse_size, plan_shards, shard_file_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5kb", 1500),
        ("64", 64),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["five", "5TB", "-1", 0])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(SafetensorsIOError, match="size"):
        parse_size(text)


def test_file_names_follow_hf_layout():
    assert shard_file_name(1, 1) == "model.safetensors"
    assert shard_file_name(2, 12) == "model-00002-of-00012.safetensors"
    assert is_layout_file("model-00002-of-00012.safetensors") and is_layout_file(
        "model.safetensors.index.json"
    )
    assert not is_layout_file("config.json") and not is_layout_file("model-2-of-3.safetensors")


def test_plan_shards_fills_in_order_without_exceeding_the_limit():
    sizes = [40, 30, 50, 10, 10, 200, 5]
    shards = plan_shards(sizes, 80)
    assert [i for shard in shards for i in shard] == list(range(len(sizes)))
    for shard in shards:
        total = sum(sizes[i] for i in shard)
        assert total <= 80 or len(shard) == 1  # an oversized item sits alone
    # a shard closes only when the next item would not fit
    for left, right in itertools.pairwise(shards):
        assert sum(sizes[i] for i in left) + sizes[right[0]] > 80
    assert plan_shards([], 10) == [[]]
