"""`MeshConfig`: degrees, the process count, and an `auto` degree resolved against a world."""

import math
import random
import re

import msgspec
import pytest

from d9d.mesh import AUTO, DEGREE_KEYS, MeshConfig, MeshConfigError, resolve_auto_degree


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


def _resolve(mesh: dict, world: int) -> MeshConfig:
    """What a job's config resolution does with a `mesh:` section on `world` processes."""
    return MeshConfig(**resolve_auto_degree(mesh, world))


def _works(mesh: dict, world: int) -> bool:
    try:
        return _resolve(mesh, world).world_size == world
    except MeshConfigError:
        return False


def test_auto_does_not_count_expert_parallel_and_fills_the_world():
    assert resolve_auto_degree({"data_parallel_shard": AUTO, "expert_parallel": 2}, 4) == {
        "data_parallel_shard": 4,
        "expert_parallel": 2,
    }
    config = _resolve({"data_parallel_shard": AUTO, "tensor_parallel": 2, "expert_parallel": 4}, 4)
    assert (config.data_parallel_shard, config.world_size, config.expert_replicate) == (2, 4, 1)
    config = _resolve({"pipeline_parallel": 2, "data_parallel_replicate": AUTO, "expert_parallel": 2}, 8)
    assert (config.data_parallel_replicate, config.world_size, config.expert_replicate) == (4, 8, 2)


@pytest.mark.parametrize(
    ("mesh", "world", "message"),
    [
        (
            {"pipeline_parallel": 2, "data_parallel_shard": AUTO, "expert_parallel": 4},
            4,
            "mesh.data_parallel_shard: auto is 2 on 4 processes, so a pipeline stage holds 2 ranks, which "
            "mesh.expert_parallel=4 does not divide; launch a multiple of 8 processes or set "
            "mesh.expert_parallel to one of [1, 2]",
        ),
        (
            {"pipeline_parallel": 2, "data_parallel_shard": AUTO, "tensor_parallel": 2, "expert_parallel": 8},
            8,
            "mesh.data_parallel_shard: auto is 2 on 8 processes, so a pipeline stage holds 4 ranks, which "
            "mesh.expert_parallel=8 does not divide; launch a multiple of 16 processes or set "
            "mesh.expert_parallel to one of [1, 2, 4]",
        ),
        (
            {"data_parallel_shard": AUTO, "tensor_parallel": 2, "expert_parallel": 4},
            3,
            "mesh.data_parallel_shard: auto needs a world of a multiple of 4 processes (of 2, the product of "
            "the other degrees, and of pipeline_parallel × expert_parallel = 4, so that "
            "mesh.expert_parallel=4 divides each pipeline stage), but 3 were launched; launch a multiple "
            "of 4 processes",
        ),
        (
            {"pipeline_parallel": AUTO, "data_parallel_shard": 2, "expert_parallel": 4},
            4,
            "mesh.expert_parallel=4 must divide data_parallel_replicate × data_parallel_shard × "
            "context_parallel × tensor_parallel = 2; choose one of [1, 2]",
        ),
        (
            {"data_parallel_shard": 2, "expert_parallel": AUTO},
            2,
            "mesh.expert_parallel cannot be auto: it regroups ranks the other degrees count and adds none; "
            "make a data-parallel degree auto and set expert_parallel to a number",
        ),
    ],
    ids=["pp2-ep4-on-4", "pp2-tp2-ep8-on-8", "tp2-ep4-on-3", "auto-pp-ep4", "auto-ep"],
)
def test_auto_with_an_expert_parallel_that_cannot_fit_names_the_world_or_the_degrees(mesh, world, message):
    with pytest.raises(MeshConfigError) as err:
        resolve_auto_degree(mesh, world)
    assert str(err.value) == message


def test_auto_with_expert_parallel_resolves_exactly_when_a_degree_fits_and_else_names_a_fix_that_works():
    """Over 3,000 seeded meshes (one auto degree, expert_parallel 1-8) and worlds 1-48: the
    resolution succeeds exactly when some value of the auto degree makes a valid mesh of the world,
    and a refusal is one line whose fix works: the smallest world that fits, or every expert_parallel
    that fits this world."""
    rng = random.Random(40)
    stage_keys = DEGREE_KEYS[:-1]
    for _ in range(3000):
        key = rng.choice(stage_keys)
        mesh: dict = {k: rng.choice([1, 2, 3, 4]) for k in rng.sample(stage_keys, 2) if k != key}
        mesh |= {"expert_parallel": rng.choice([1, 2, 3, 4, 8]), key: AUTO}
        world = rng.randint(1, 48)
        fitting = [v for v in range(1, world + 1) if _works({**mesh, key: v}, world)]
        try:
            config = _resolve(mesh, world)
        except MeshConfigError as exc:
            message = str(exc)
            assert not fitting and "\n" not in message, (mesh, world, message)
            bound = math.prod(v for k, v in mesh.items() if k != key) * 8  # past every world that fits
            worlds = [w for w in range(1, bound + 1) if _works(mesh, w)]
            launch = re.search(r"launch a multiple of (\d+)", message)
            assert (launch is not None) == bool(worlds), (mesh, world, message)
            if launch:  # the smallest world that fits, and its multiples
                assert int(launch[1]) == worlds[0] and _works(mesh, 2 * worlds[0]), (mesh, world, message)
            # expert_parallel values that fit this world, or (auto on pipeline_parallel, whose stage no
            # world changes) that make the mesh launchable at all
            choices = re.search(r"(set mesh.expert_parallel to|choose) one of \[([\d, ]+)\]", message)
            if choices and choices[1] != "choose":  # every expert_parallel that fits this world
                fit = [ep for ep in range(1, world + 1) if _works({**mesh, "expert_parallel": ep}, world)]
                assert [int(ep) for ep in choices[2].split(", ")] == fit, (mesh, world, message)
            elif choices:
                for ep in map(int, choices[2].split(", ")):
                    other = {**mesh, "expert_parallel": ep}
                    assert any(_works(other, w) for w in range(1, bound)), (mesh, world, message, ep)
            assert launch or choices, (mesh, world, message)
            continue
        assert fitting == [getattr(config, key)] and config.world_size == world, (mesh, world)
