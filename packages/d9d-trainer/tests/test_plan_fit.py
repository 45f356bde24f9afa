"""`plan_fit`: whether a plan fits a device and which levers would make it, each re-planned (the
quickstart's levers through `d9d plan --device-memory` are tested in tests/test_plan_fit.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _job import job_config

from d9d.trainer import ConfigError, load_job_config
from d9d.trainer.planning import FIT_HEADROOM, plan_config, plan_fit, plan_job

AC_FULL = "trainer.activation_checkpointing.mode=full"
MICROBATCH_OF_ONE = "data.microbatch_size=1"


def _loaded(tmp_path, *overrides: str, **sections):
    # a longer sequence than the default 8 so that activations weigh next to the state
    config = job_config(str(tmp_path / "runs"), dataset={"seq_len": 64}, **sections)
    return load_job_config(config, list(overrides))


def _device_for(total: int, share: float) -> int:
    """Device memory whose budget is `share` of `total`."""
    return int(total * share / FIT_HEADROOM)


def _keys(overrides: tuple[str, ...]) -> frozenset[str]:
    return frozenset(item.partition("=")[0] for item in overrides)


def _dp_shard(overrides: tuple[str, ...]) -> int | None:
    values = [int(v) for k, _, v in (o.partition("=") for o in overrides) if k == "mesh.data_parallel_shard"]
    return values[-1] if values else None


def test_a_job_that_fits_has_no_levers_and_says_its_margin(tmp_path):
    loaded = _loaded(tmp_path)
    plan = plan_config(loaded)
    device = _device_for(plan.memory.total, 2.0)
    fit = plan_fit(plan, loaded, device)
    assert fit.fits and fit.levers == ()
    assert fit.budget == int(device * FIT_HEADROOM)
    assert fit.total == plan.memory.total and fit.margin == fit.budget - fit.total > 0


def test_every_lever_is_the_job_re_planned_with_its_overrides(tmp_path):
    loaded = _loaded(tmp_path, "mesh.data_parallel_replicate=2")
    plan = plan_config(loaded)
    fit = plan_fit(plan, loaded, _device_for(plan.memory.total, 0.9))
    assert not fit.fits and fit.levers
    keys = [_keys(lever.overrides) for lever in fit.levers]
    assert frozenset({AC_FULL.partition("=")[0]}) in keys
    assert frozenset({MICROBATCH_OF_ONE.partition("=")[0]}) in keys
    assert frozenset({"mesh.data_parallel_replicate", "mesh.data_parallel_shard"}) in keys
    for lever in fit.levers:
        again = plan_config(load_job_config(job_config(str(tmp_path / "runs"), dataset={"seq_len": 64}),
                                            ["mesh.data_parallel_replicate=2", *lever.overrides]))  # fmt: skip
        assert again.memory.total == lever.total
        assert lever.fits == (lever.total <= fit.budget)
        assert again.mesh.world_size == lever.world_size
    reshard = fit.levers[keys.index(frozenset({"mesh.data_parallel_replicate", "mesh.data_parallel_shard"}))]
    assert reshard.world_size == plan.mesh.world_size  # the same processes
    assert reshard.total < fit.total


@pytest.mark.parametrize(
    ("overrides", "absent"),
    [
        ([AC_FULL], AC_FULL),  # already on
        (["data.microbatch_size=1"], MICROBATCH_OF_ONE),  # already 1
        ([], "mesh.data_parallel_replicate=1"),  # nothing replicated
    ],
    ids=["ac-already-full", "microbatch-already-1", "no-replication"],
)
def test_a_lever_is_offered_only_where_it_applies(tmp_path, overrides, absent):
    loaded = _loaded(tmp_path, *overrides)
    plan = plan_config(loaded)
    fit = plan_fit(plan, loaded, _device_for(plan.memory.total, 0.99))
    assert not fit.fits and fit.levers
    assert all(absent not in lever.overrides for lever in fit.levers)


def test_more_ranks_is_the_smallest_doubling_of_dp_shard_that_fits(tmp_path):
    loaded = _loaded(tmp_path, "mesh.data_parallel_shard=2", "data.global_batch_size=32")
    plan = plan_config(loaded)
    fit = plan_fit(plan, loaded, _device_for(plan.memory.total, 0.7))
    (scaled,) = [lever for lever in fit.levers if lever.overrides[0].startswith("mesh.data_parallel_shard=")]
    shard = _dp_shard(scaled.overrides)
    assert scaled.fits and shard is not None and shard > 2
    assert scaled.world_size == shard
    if shard // 2 > 2:  # half of it does not fit
        assert (
            plan_config(loaded.with_overrides([f"mesh.data_parallel_shard={shard // 2}"])).memory.total
            > fit.budget
        )


def test_doublings_stop_where_the_global_batch_no_longer_splits(tmp_path):
    loaded = _loaded(tmp_path)  # global batch 8 in microbatches of 2: at most 4 data-parallel ranks
    plan = plan_config(loaded)
    fit = plan_fit(plan, loaded, 1)  # nothing fits in one byte
    assert not any(lever.fits for lever in fit.levers)
    (scaled,) = [lever for lever in fit.levers if _keys(lever.overrides) == {"mesh.data_parallel_shard"}]
    assert _dp_shard(scaled.overrides) == 4 and scaled.world_size == 4
    with pytest.raises(ConfigError, match="not divisible"):
        plan_config(loaded.with_overrides(["mesh.data_parallel_shard=8"]))
    # with nothing fitting, the last one is every lever at once (microbatches of 1 allow 8 ranks)
    last = fit.levers[-1]
    assert _keys(last.overrides) == {
        AC_FULL.partition("=")[0],
        "data.microbatch_size",
        "optimizer.state_dtype",
        "mesh.data_parallel_shard",
    }
    assert _dp_shard(last.overrides) == 8 and last.total < scaled.total


def test_combinations_are_tried_when_no_single_lever_fits_and_only_the_smallest_are_listed(tmp_path):
    loaded = _loaded(tmp_path, "data.global_batch_size=64")
    plan = plan_config(loaded)
    singles = [lever for lever in plan_fit(plan, loaded, 1).levers if len(_keys(lever.overrides)) == 1]
    assert len(singles) == 4  # each lever alone (AC, microbatch 1, bf16 states, more ranks), at its smallest
    best_single = min(lever.total for lever in singles)
    fit = plan_fit(plan, loaded, int(best_single * 0.8 / FIT_HEADROOM))
    combined = [lever for lever in fit.levers if len(_keys(lever.overrides)) > 1]
    assert not any(lever.fits for lever in fit.levers if lever not in combined)
    fitting = [_keys(lever.overrides) for lever in combined if lever.fits]
    assert fitting, fit.levers
    assert not any(a < b for a in fitting for b in fitting)  # none holds a smaller one that fits


def test_plan_fit_needs_a_memory_estimate_and_a_positive_size(tmp_path):
    from d9d.mesh import DistributedContext
    from d9d.trainer import resolve_job

    loaded = _loaded(tmp_path)
    with DistributedContext.from_env(environ={}, device="cpu") as context:
        bare = plan_job(resolve_job(loaded), context)
    with pytest.raises(ValueError, match="memory=True"):
        plan_fit(bare, loaded, 2**30)
    with pytest.raises(ValueError, match="positive"):
        plan_fit(plan_config(loaded), loaded, 0)


def test_with_overrides_is_loading_with_the_overrides_appended(tmp_path):
    config = job_config(str(tmp_path / "runs"))
    loaded = load_job_config(config, ["mesh.data_parallel_shard=2"])
    changed = loaded.with_overrides(["data.microbatch_size=1", "mesh.data_parallel_shard=4"])
    direct = load_job_config(config, ["mesh.data_parallel_shard=2", "data.microbatch_size=1",
                                      "mesh.data_parallel_shard=4"])  # fmt: skip
    assert changed.config == direct.config and changed.raw == direct.raw and changed.path == loaded.path
    assert loaded.config.mesh.data_parallel_shard == 2  # unchanged
