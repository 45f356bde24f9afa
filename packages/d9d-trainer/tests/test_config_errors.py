"""Bad configs fail before anything starts, with one line naming the key path and the fix."""

import itertools
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import ConfigError, Trainer, load_job_config
from d9d.trainer.builtins.optim import lr_multiplier


def _set(config, path, value):
    node = config
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (
            "trainer.schedul",
            {},
            r"unknown key trainer\.schedul; valid keys here: run, schedule, checkpointing",
        ),
        ("trainer.schedule.total_steps", "many", r"trainer\.schedule\.total_steps: Expected int, got str"),
        ("trainer.schedule.total_steps", 0, r"trainer\.schedule\.total_steps must be >= 1, got 0"),
        ("mesh.tensor_parallel", 0, r"mesh\.tensor_parallel must be >= 1, got 0"),
        (
            "mesh.data_parallel_shards",
            2,
            r"unknown key mesh\.data_parallel_shards; valid keys here: pipeline_parallel",
        ),
        ("optimizer.name", "adam", r"optimizer\.name: Invalid enum value 'adam'"),
        ("trainer.checkpointing.num_to_keep", 0, r"num_to_keep must be >= 1"),
        ("trainer.run.name", "a/b", r"trainer\.run\.name must be a plain directory name"),
        ("data.global_batch_size", "8x", r"data\.global_batch_size: Expected int, got str"),
        (
            "data.micro_batch_size",
            2,
            r"unknown key data\.micro_batch_size; valid keys here: global_batch_size",
        ),
        ("model.hiden", 4, r"unknown key model\.hiden; valid keys here: vocab, hidden, layers"),
        (
            "providers.model",
            "nowhere.module:Thing",
            r"providers\.model: cannot import module 'nowhere\.module'",
        ),
        ("providers.model", "_job:Missing", r"providers\.model: '_job' has no attribute 'Missing'"),
        ("providers.model", "no_such_file.py:Thing", r"providers\.model: 'no_such_file\.py:Thing': no file"),
        ("providers.model", "justaname", r"must look like package\.module:Name or file\.py:Name"),
        (
            "providers.task",
            "_job:TinyConfig",
            r"providers\.task \(TinyConfig\) lacks batch_weight, compute_loss",
        ),
    ],
)
def test_bad_config_is_one_clear_error(tmp_path, path, value, message):
    config = _set(job_config(str(tmp_path)), path, value)
    with pytest.raises(ConfigError, match=message) as info:
        Trainer.from_config(config)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "tiny").exists()  # nothing written


def test_missing_required_and_missing_dataset(tmp_path):
    config = job_config(str(tmp_path))
    del config["trainer"]["schedule"]
    with pytest.raises(ConfigError, match=r"missing required key trainer\.schedule"):
        Trainer.from_config(config)
    config = job_config(str(tmp_path))
    del config["providers"]["dataset"]
    with pytest.raises(ConfigError, match=r"providers\.dataset is missing"):
        Trainer.from_config(config)


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"no such config file"):
        load_job_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  run: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line \d+"):
        load_job_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_job_config(bad)


def test_overrides_are_typed_by_the_schema(tmp_path):
    loaded = load_job_config(
        job_config(str(tmp_path)),
        ["trainer.schedule.total_steps=400", "mesh.data_parallel_shard=2", "trainer.logging.log_dir=null"],
    )
    assert loaded.config.trainer.schedule.total_steps == 400
    assert loaded.config.mesh.data_parallel_shard == 2
    assert loaded.config.trainer.logging.log_dir is None
    with pytest.raises(ConfigError, match=r"must look like key\.path=value"):
        load_job_config(job_config(str(tmp_path)), ["trainer.schedule.total_steps"])
    with pytest.raises(ConfigError, match=r"trainer\.schedule\.total_steps: Expected int, got str"):
        load_job_config(job_config(str(tmp_path)), ["trainer.schedule.total_steps=lots"])


def test_lr_schedule_shapes():
    kw = {"warmup_steps": 2, "total_steps": 12, "min_lr_ratio": 0.1}
    assert [lr_multiplier(s, name="constant", **kw) for s in range(4)] == [1 / 3, 2 / 3, 1.0, 1.0]
    cosine = [lr_multiplier(s, name="cosine", **kw) for s in range(12)]
    linear = [lr_multiplier(s, name="linear", **kw) for s in range(12)]
    assert (
        cosine[2] == linear[2] == 1.0
        and cosine[-1] == pytest.approx(0.1)
        and linear[-1] == pytest.approx(0.1)
    )
    assert all(a >= b for a, b in itertools.pairwise(cosine[2:]))
    assert linear[7] == pytest.approx(1 - 0.9 * 5 / 9)


def test_a_config_path_field_arrives_absolute_from_the_config_files_directory(tmp_path):
    import msgspec

    from d9d.trainer import ConfigPath, resolve_job

    (tmp_path / "own.py").write_text(
        "import msgspec\n"
        "from d9d.trainer import ConfigPath\n\n"
        "class Inner(msgspec.Struct):\n    file: ConfigPath\n\n"
        "class Section(msgspec.Struct):\n"
        "    folder: ConfigPath\n    optional: ConfigPath | None = None\n    name: str = 'x'\n    inner: Inner | None = None\n\n"
        "class Data:\n    config_type = Section\n\n"
        "    def __init__(self, config):\n        self.config = config\n\n"
        "    def build_dataset(self, context):\n        raise NotImplementedError\n",
        encoding="utf-8",
    )
    config = job_config(str(tmp_path / "runs"))
    config["providers"]["dataset"] = "own.py:Data"
    config["dataset"] = {"folder": "models/m", "name": "rel", "inner": {"file": "/abs/f"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    section = resolve_job(load_job_config(tmp_path / "config.yaml")).sections["dataset"]
    assert section.folder == str(tmp_path / "models" / "m") and section.optional is None
    assert section.name == "rel" and section.inner.file == "/abs/f"  # a plain str stays as written
    assert msgspec.convert("p", ConfigPath) == "p"


def test_a_profiling_window_after_the_last_step_is_refused(tmp_path):
    config = job_config(str(tmp_path), total_steps=4)
    config["trainer"]["profiling"] = {"start_step": 5, "active_steps": 2}
    with pytest.raises(ConfigError, match=r"trainer\.profiling\.start_step=5 is after the last step"):
        Trainer.from_config(config)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("key", "section"),
    [
        ("trainer.profiling.dir", {"profiling": {"active_steps": 1, "dir": "blocker/profile"}}),
        (
            "trainer.tracking.tensorboard_dir",
            {"tracking": {"backends": ["tensorboard"], "tensorboard_dir": "blocker/tb"}},
        ),
    ],
    ids=["profiling", "tensorboard"],
)
def test_a_file_where_a_profile_or_tracker_dir_goes_is_one_line_naming_the_key(tmp_path, key, section):
    (tmp_path / "blocker").write_text("a file")
    config = job_config(str(tmp_path / "runs"))
    config["trainer"].update(section)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{key.replace('.', chr(92) + '.')}: .*blocker is a file"):
        Trainer.from_config(tmp_path / "config.yaml")
    assert not (tmp_path / "runs").exists()


def test_an_unknown_tracker_backend_names_the_valid_ones(tmp_path):
    config = job_config(str(tmp_path))
    config["trainer"]["tracking"] = {"backends": ["jsonl", "tensorbord"]}
    with pytest.raises(
        ConfigError, match=r"backends\[1\]: Invalid enum value 'tensorbord'; choose one of jsonl, tensorboard"
    ):
        load_job_config(config)
