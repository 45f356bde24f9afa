import msgspec
import pytest

from d9d.mesh import DEGREE_KEYS, MeshConfig, MeshConfigError


def test_defaults_are_local():
    config = MeshConfig()
    assert all(getattr(config, key) == 1 for key in DEGREE_KEYS)
    assert config.world_size == 1
    assert config.is_local


def test_world_size_is_product_without_expert_parallel():
    config = MeshConfig(
        pipeline_parallel=2,
        data_parallel_replicate=3,
        data_parallel_shard=2,
        context_parallel=1,
        tensor_parallel=2,
        expert_parallel=4,
    )
    assert config.world_size == 2 * 3 * 2 * 2
    assert config.data_parallel == 6
    assert config.non_pipeline_size == 12
    assert config.expert_replicate == 3


@pytest.mark.parametrize("key", DEGREE_KEYS)
@pytest.mark.parametrize("value", [0, -2])
def test_degree_below_one_names_key(key, value):
    with pytest.raises(MeshConfigError, match=rf"mesh\.{key} must be >= 1, got {value}"):
        MeshConfig(**{key: value})


@pytest.mark.parametrize("value", [1.5, "2", True])
def test_degree_must_be_integer(value):
    with pytest.raises(MeshConfigError, match=r"mesh\.tensor_parallel must be an integer"):
        MeshConfig(tensor_parallel=value)


def test_expert_parallel_must_divide_non_pipeline_ranks():
    with pytest.raises(
        MeshConfigError, match=r"expert_parallel=3 must divide .* = 4; choose one of \[1, 2, 4\]"
    ):
        MeshConfig(data_parallel_shard=4, expert_parallel=3)
    # pipeline ranks do not count towards what expert_parallel regroups
    with pytest.raises(MeshConfigError, match="expert_parallel=4"):
        MeshConfig(pipeline_parallel=2, data_parallel_shard=2, expert_parallel=4)
    assert MeshConfig(data_parallel_shard=2, tensor_parallel=2, expert_parallel=4).world_size == 4


def test_decode_rejects_unknown_keys_and_wrong_types():
    with pytest.raises(msgspec.ValidationError, match="unknown field `tensor_paralel`"):
        msgspec.convert({"tensor_paralel": 2}, MeshConfig)
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int`, got `str` - at `\$.tensor_parallel`"):
        msgspec.convert({"tensor_parallel": "2"}, MeshConfig)
    with pytest.raises(msgspec.ValidationError, match=r"mesh\.data_parallel_shard must be >= 1"):
        msgspec.convert({"data_parallel_shard": 0}, MeshConfig)


def test_config_is_frozen():
    config = MeshConfig()
    with pytest.raises(AttributeError):
        config.tensor_parallel = 2  # type: ignore[misc]


def test_describe_degrees():
    assert MeshConfig().describe_degrees() == "all degrees 1"
    assert MeshConfig(data_parallel_shard=2, tensor_parallel=2).describe_degrees() == (
        "data_parallel_shard=2, tensor_parallel=2"
    )
