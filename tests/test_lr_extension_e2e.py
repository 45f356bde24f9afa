"""Extending a finished quickstart run by raising `trainer.schedule.total_steps`, as a user does
(`python train.py config.yaml trainer.schedule.total_steps=M` on the same run): what each schedule
does to the learning rate.

cosine was at 0 on its last step and resumes on the curve stretched over the new total, at the new
curve's value of that step (a jump from 0, with one warning naming wsd). wsd resumed from its last
stable checkpoint (the decayed ones moved out of the run directory, as its warning on a decayed
checkpoint says) keeps the peak without a jump, decays over the new end, and trains exactly as an
uninterrupted run of M steps.
"""

import json
import math
import shutil
from pathlib import Path

from _quickstart import overrides, records, run_main

N, M = 8, 16  # the finished run's steps, the raised total
WARMUP = 2  # the tiny quickstart's lr_scheduler.warmup_steps
PEAK = 3e-3  # the quickstart's optimizer.lr


def _train(save_dir: Path, name: str, steps: int, *schedule: str) -> list[dict]:
    """Run (or resume) the tiny quickstart; its log lines (JSON)."""
    done = run_main(overrides(save_dir, name, steps, *schedule, "trainer.logging.format=json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _warnings(lines: list[dict]) -> list[dict]:
    return [r for r in lines if r.get("level") == "warning"]


def _lrs(run_dir: Path) -> list[float]:
    return [r["lr"] for r in records(run_dir)]


def test_cosine_raised_after_its_end_jumps_from_zero_onto_the_stretched_curve_and_warns(tmp_path):
    _train(tmp_path, "cos", N, "lr_scheduler.name=cosine")
    assert _lrs(tmp_path / "cos")[-1] == 0.0  # a finished cosine run ends at its minimum
    warnings = _warnings(_train(tmp_path, "cos", M, "lr_scheduler.name=cosine"))
    lrs = _lrs(tmp_path / "cos")
    # the cosine over M steps, from its definition: step s (0-based) is (s − warmup)/(M − warmup − 1) down
    stretched = [PEAK * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (M - WARMUP - 1))) for s in range(N, M)]
    assert [round(lr / PEAK, 12) for lr in lrs[N:]] == [round(lr / PEAK, 12) for lr in stretched]
    assert lrs[N] > 0.5 * PEAK  # from 0 at step N to more than half the peak at step N + 1
    (warning,) = [w for w in warnings if w["event"].startswith("lr_scheduler cosine is re-stretched")]
    assert (warning["step"], warning["checkpoint_lr"], warning["lr"]) == (N + 1, 0.0, lrs[N])
    assert "wsd is the schedule meant for extension" in warning["event"]


def test_wsd_extended_from_its_last_stable_checkpoint_keeps_the_peak_and_decays_at_the_new_end(tmp_path):
    wsd = ("lr_scheduler.name=wsd", "lr_scheduler.decay_steps=2")  # steps N-1 and N decay
    _train(tmp_path, "wsd", N, *wsd)
    first = _lrs(tmp_path / "wsd")
    assert first[WARMUP : N - 2] == [PEAK] * (N - 2 - WARMUP) and first[-1] == 0.0

    # the decayed checkpoints out of the run directory (as the warning on resuming from the decayed
    # end says: test_lr_resume.py), so the last stable one resumes
    for decayed in (tmp_path / "wsd").glob("save-*"):
        if int(decayed.name.removeprefix("save-")) > N - 2:
            shutil.move(decayed, tmp_path / f"aside-{decayed.name}")
    logged = _train(tmp_path, "wsd", M, *wsd)
    lrs = _lrs(tmp_path / "wsd")
    assert lrs[WARMUP : M - 2] == [PEAK] * (M - 2 - WARMUP)  # the peak on through the old decay's steps
    assert PEAK > lrs[M - 2] > lrs[M - 1] == 0.0  # the decay at the new end
    assert [w["event"] for w in _warnings(logged)] == ["resumed with a changed setting"]  # total_steps
    (note,) = [r for r in logged if r["event"].startswith("lr_scheduler wsd goes on at the peak")]
    assert note["event"].endswith(f"its decay moves to steps {M - 1}..{M}")
    _train(tmp_path, "wsd-uninterrupted", M, *wsd)
    uninterrupted = records(tmp_path / "wsd-uninterrupted")
    assert [(r["lr"], r["loss"]) for r in records(tmp_path / "wsd")] == [
        (r["lr"], r["loss"]) for r in uninterrupted
    ]
