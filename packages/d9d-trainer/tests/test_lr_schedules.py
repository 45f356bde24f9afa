"""The built-in learning-rate schedules against their definitions: warmup-stable-decay warms up to the
peak, holds it exactly, and decays over its last steps to the minimum, monotonically; cosine and
linear reach the minimum at the last step."""

import itertools
import math

import pytest

from d9d.trainer.builtins.optim import BuiltinLRSchedulerProvider, lr_multiplier, wsd_decay_start
from d9d.trainer.config.job import LRSchedulerConfig
from d9d.trainer.job.load import ConfigError, load_job_config


def _wsd(total: int, warmup: int, min_ratio: float = 0.0, **decay: object) -> list[float]:
    return [
        lr_multiplier(s, name="wsd", warmup_steps=warmup, total_steps=total, min_lr_ratio=min_ratio, **decay)  # type: ignore[arg-type]
        for s in range(total)
    ]


@pytest.mark.parametrize(
    ("total", "warmup", "decay_steps", "shape", "min_ratio"),
    [
        (40, 5, 8, "linear", 0.0),
        (40, 5, 8, "1-sqrt", 0.1),
        (12, 0, 1, "linear", 0.2),
        (30, 4, 26, "linear", 0.0),
    ],
    ids=["linear", "1-sqrt", "one-step-decay", "decay-right-after-warmup"],
)
def test_wsd_warms_up_holds_the_peak_then_decays_over_its_last_steps_to_the_minimum(
    total, warmup, decay_steps, shape, min_ratio
):
    lrs = _wsd(total, warmup, min_ratio, decay_steps=decay_steps, decay_shape=shape)
    # warmup: rising from above 0, below the peak, which the first step after it reaches
    assert all(0 < a < b < 1 for a, b in itertools.pairwise(lrs[:warmup])) and lrs[warmup - 1 : warmup] != [
        1.0
    ]
    assert lrs[warmup] == 1.0 or decay_steps > total - warmup - 1
    # stable: exactly the peak until the last `decay_steps` steps
    start = total - decay_steps
    assert lrs[warmup:start] == [1.0] * (start - warmup)
    # decay: `decay_steps` steps, each below the one before, down to the minimum at the last step
    assert sum(1 for x in lrs[warmup:] if x < 1.0) == decay_steps
    assert all(a > b for a, b in itertools.pairwise([1.0, *lrs[start:]]))
    assert lrs[-1] == pytest.approx(min_ratio, abs=1e-12) and all(x >= min_ratio for x in lrs)


def test_1_sqrt_drops_faster_than_linear_early_in_the_decay_and_meets_it_at_the_end():
    linear = _wsd(40, 5, decay_steps=8, decay_shape="linear")
    sqrt = _wsd(40, 5, decay_steps=8, decay_shape="1-sqrt")
    assert sqrt[:32] == linear[:32]  # the same warmup and stable phase
    assert all(s < lin for s, lin in zip(sqrt[32:-1], linear[32:-1], strict=True))
    assert sqrt[-1] == linear[-1] == 0.0


def test_wsd_without_decay_steps_decays_over_decay_ratio_of_total_steps():
    for total, ratio in ((50, 0.2), (200, 0.1), (7, 0.5)):
        lrs = _wsd(total, 2, decay_ratio=ratio)
        assert sum(1 for x in lrs[2:] if x < 1.0) == round(ratio * total), (total, ratio)
        assert wsd_decay_start(total, 2, ratio, None) == total - round(ratio * total)


def test_raising_total_steps_keeps_wsds_stable_phase_and_moves_its_decay_to_the_end():
    short, long = _wsd(20, 2, decay_steps=4), _wsd(40, 2, decay_steps=4)
    assert long[:16] == short[:16]  # every step before the short run's decay: unchanged
    assert long[16:36] == [1.0] * 20 and long[36:] == short[16:]  # then the same decay, at the new end


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_cosine_and_linear_decay_from_the_peak_after_warmup_to_the_minimum_at_the_last_step(name):
    total, warmup, low = 30, 3, 0.1
    lrs = [
        lr_multiplier(s, name=name, warmup_steps=warmup, total_steps=total, min_lr_ratio=low)
        for s in range(total)
    ]
    assert lrs[warmup] == 1.0 and lrs[-1] == pytest.approx(low)
    assert all(a > b for a, b in itertools.pairwise(lrs[warmup:]))
    middle = (warmup + total - 1) / 2  # half-way through the decay: half-way down, on either curve
    half = low + (1 - low) * (0.5 if name == "linear" else 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(
        int(middle), name=name, warmup_steps=warmup, total_steps=total, min_lr_ratio=low
    ) == (pytest.approx(half, abs=0.06))


def test_bad_decay_settings_are_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"lr_scheduler\.decay_steps must be >= 1"):
        LRSchedulerConfig(name="wsd", decay_steps=0)
    path = tmp_path / "c.yaml"
    path.write_text(
        "providers: {model: m:M}\ntrainer: {run: {name: r}, schedule: {total_steps: 4}}\n"
        "lr_scheduler: {name: wsd, decay_shape: cosine}\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"lr_scheduler\.decay_shape"):
        load_job_config(path)


def test_the_warning_on_a_new_total_starts_with_the_first_checkpoint_inside_wsds_old_decay():
    wsd = BuiltinLRSchedulerProvider(LRSchedulerConfig(name="wsd", warmup_steps=2, decay_steps=3))
    last_stable = 10 - 3  # steps 8..10 of 10 decay
    level, text = wsd.new_total_note(last_stable, 10, 20) or ("", "")
    assert level == "info" and text.endswith(
        "its decay moves to steps 18..20"
    )  # from the stable phase it goes on
    level, text = wsd.new_total_note(last_stable + 1, 10, 20) or ("", "")
    assert level == "warning" and f"resume from a checkpoint of step {last_stable} or before" in text
    for name in ("cosine", "linear"):
        decaying = BuiltinLRSchedulerProvider(LRSchedulerConfig(name=name, warmup_steps=2))
        assert decaying.new_total_note(1, 10, 20) is None  # still warming up: nothing moves
        assert (decaying.new_total_note(2, 10, 20) or ("",))[0] == "warning"
        assert decaying.new_total_note(5, 10, 10) is None  # the same total
    assert BuiltinLRSchedulerProvider(LRSchedulerConfig(name="constant")).new_total_note(10, 10, 20) is None
