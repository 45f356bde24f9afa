import msgspec
import pytest

from d9d.data import AutoDataConfig, DataConfigError


def test_defaults_and_decoding_from_a_config_section():
    config = msgspec.convert({"global_batch_size": 32, "microbatch_size": 4}, AutoDataConfig)
    assert (config.shuffle, config.seed, config.drop_last, config.num_workers) == (True, 0, True, 0)
    assert (config.pin_memory, config.prefetch) == ("auto", 2)
    for value in (True, False, "auto"):
        assert (
            msgspec.convert({"global_batch_size": 8, "pin_memory": value}, AutoDataConfig).pin_memory == value
        )
    with pytest.raises(msgspec.ValidationError, match="pin_memory"):
        msgspec.convert({"global_batch_size": 8, "pin_memory": "yes"}, AutoDataConfig)


def test_unknown_keys_and_wrong_types_are_errors():
    with pytest.raises(msgspec.ValidationError, match="micro_batch_size"):
        msgspec.convert({"global_batch_size": 32, "micro_batch_size": 4}, AutoDataConfig)
    with pytest.raises(msgspec.ValidationError, match="global_batch_size"):
        msgspec.convert({"global_batch_size": "32"}, AutoDataConfig)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch_size": 0}, "data.global_batch_size must be an integer >= 1, got 0"),
        ({"global_batch_size": 8, "microbatch_size": -1}, "data.microbatch_size must be an integer >= 1"),
        ({"global_batch_size": 8, "num_workers": -1}, "data.num_workers must be an integer >= 0"),
        ({"global_batch_size": 8, "prefetch": 0}, "data.prefetch must be an integer >= 1"),
        ({"global_batch_size": 8, "seed": -2}, "data.seed must be an integer >= 0"),
    ],
)
def test_bad_values_name_the_key(kwargs, message):
    with pytest.raises(DataConfigError, match=message):
        AutoDataConfig(**kwargs)
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(kwargs, AutoDataConfig)


def test_pin_memory_accepts_only_true_false_or_auto():
    with pytest.raises(DataConfigError, match=r"data\.pin_memory must be true, false or .auto., got .yes."):
        AutoDataConfig(global_batch_size=8, pin_memory="yes")  # type: ignore[arg-type]
