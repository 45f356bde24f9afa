"""The GPU check gives every check its summary line whatever happens, inside its budget, and reads what
the runs write: its plan and runner (benchmarks/gpu_check_run.py), its entry (gpu_check.sh) and the
summary of a training run's records (gpu_check.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check_run  # noqa: E402
from gpu_check_run import Check, deadlines, plan, run  # noqa: E402


def _summary(out: Path) -> list[list[str]]:
    return [line.split() for line in (out / "summary.txt").read_text().splitlines()]


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_out_of_budget_every_check_of_the_plan_still_has_its_line_in_the_plans_order(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DEVICE="cpu", PY=sys.executable, BUDGET_S="1")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    names = [c.name for c in plan(sys.executable, "cpu", tmp_path)]
    lines = _summary(out)
    assert [line[1] for line in lines] == names, lines
    assert all(line[2:5] == ["SKIP", "out", "of"] for line in lines), lines
    assert (out / "logs.tgz").is_file()
    # the headline first: versions, the throughput phases, MoE, host syncs, then the correctness checks
    first = {name: names.index(name) for name in ("moe", "syncs", "quickstart")}
    phases = [i for i, name in enumerate(names) if name.startswith("tp_")]
    assert names[0] == "env" and phases == list(range(1, 6)), names
    assert phases[-1] < first["moe"] < first["syncs"] < first["quickstart"], names


def test_the_shares_add_up_to_the_budget_and_each_is_its_weights_part():
    checks = [Check("a", 1, ()), Check("b", 3, ()), Check("free", 0, ()), Check("c", 4, ())]
    ends = deadlines(checks, 100.0, 80.0 + gpu_check_run.RESERVE_S)
    assert ends == [110.0, 140.0, 140.0, 180.0]  # 80 s over weights 1+3+0+4; weight 0: only what is left


def _two_checks(tmp_path: Path, budget: float, monkeypatch) -> list[list[str]]:
    monkeypatch.setattr(gpu_check_run, "MIN_LIMIT_S", 1)
    checks = [
        Check("slow", 1, _python("import time; time.sleep(30)")),
        Check("late", 0, _python("print('RESULT late PASS ran')")),
    ]
    code = run(checks, budget, set(), tmp_path / "summary.txt", tmp_path)
    assert code == 1
    return [line.split() for line in (tmp_path / "summary.txt").read_text().splitlines()]


def test_a_check_past_its_share_is_stopped_and_says_so_and_the_next_is_not_started(tmp_path, monkeypatch):
    lines = _two_checks(tmp_path, gpu_check_run.RESERVE_S + 4.0, monkeypatch)
    assert [line[:6] for line in lines] == [
        ["RESULT", "slow", "FAIL", "out", "of", "budget:"],
        ["RESULT", "late", "SKIP", "out", "of", "budget:"],
    ], lines


def test_a_check_prints_its_own_line_or_gets_one_from_its_exit_status(tmp_path):
    checks = [
        Check("own", 1, _python("print('RESULT own INFO 3 tok/s')")),
        Check("quiet", 1, _python("pass")),
        Check("broken", 1, _python("import sys; sys.exit('no GPU here')")),
        Check("crashed", 1, _python("print('RESULT crashed PASS fine'); import sys; sys.exit(3)")),
        Check("skipped", 1, _python("pass")),
    ]
    code = run(checks, 600.0, {"skipped"}, tmp_path / "summary.txt", tmp_path)
    lines = (tmp_path / "summary.txt").read_text().splitlines()
    assert code == 1
    assert [line.split()[1:3] for line in lines] == [
        ["own", "INFO"],
        ["quiet", "PASS"],
        ["broken", "FAIL"],
        ["crashed", "FAIL"],  # a crash after its line (teardown, a second failure) fails it
        ["skipped", "SKIP"],
    ]
    assert "3 tok/s" in lines[0] and "no GPU here" in lines[2]


_STOPPABLE = """
import sys
sys.path.insert(0, {benchmarks!r})
import gpu_check_run as r
checks = [r.Check("first", 1, ({py!r}, "-c", "print('RESULT first PASS')")),
          r.Check("second", 1, ({py!r}, "-c", "import time; time.sleep(60)")),
          r.Check("third", 1, ({py!r}, "-c", "pass"))]
import signal
signal.signal(signal.SIGTERM, r._stop)
sys.exit(r.run(checks, 600.0, set(), r.Path({summary!r}), r.Path({logs!r})))
"""


def test_a_stopped_run_still_gives_every_check_its_line(tmp_path):
    summary = tmp_path / "summary.txt"
    code = _STOPPABLE.format(benchmarks=str(ROOT / "benchmarks"), py=sys.executable, summary=str(summary),
                             logs=str(tmp_path))  # fmt: skip
    runner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    while not (tmp_path / "second.log").exists():  # the runner is inside the second check
        assert runner.poll() is None, "the runner ended before its second check"
        time.sleep(0.1)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 1
    lines = [line.split()[1:3] for line in summary.read_text().splitlines()]
    assert lines == [["first", "PASS"], ["second", "FAIL"], ["third", "SKIP"]], lines


def test_the_summary_of_a_run_shows_the_peak_memory_its_records_write_on_cuda(tmp_path, monkeypatch):
    import gpu_check

    from d9d.trainer.observe import records

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    memory = records._memory(torch.device("cuda"))  # what a CUDA run's records carry
    assert memory  # a key and its value
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 5.0, "tokens_per_s": 10.0, **memory}, {"step": 2, "loss": 4.0, **memory}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok, line = gpu_check.metrics_line(path)
    assert ok and "loss 5.000->4.000" in line
    for key, value in memory.items():
        assert f"{key}={value:.4g}" in line, line


def test_without_the_wheels_the_entry_says_what_to_run_and_writes_nothing(tmp_path):
    bare = tmp_path / "python"  # a Python that sees no installed package: as on the bare GPU machine
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PY=str(bare), WHEELS=str(tmp_path / "none"), DEVICE="cpu")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "msgspec" in done.stderr, done.stderr
    assert "prepare_gpu_check.sh" in done.stderr and not out.exists()


def test_the_prepare_script_refuses_a_wheel_folder_git_would_commit():
    wheels = "benchmarks/not-ignored"
    env = dict(os.environ, WHEELS=wheels)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "prepare_gpu_check.sh")], capture_output=True,
                          text=True, env=env, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and ".gitignore" in done.stderr, done.stderr
    assert not (ROOT / wheels).exists()


def test_a_misspelt_setting_is_one_line_naming_it_and_nothing_is_written(tmp_path):
    for setting in ({"SKIP": "tp_bf16 flexx"}, {"DEVICE": "gpu"}, {"BUDGET_S": "9 min"}):
        out = tmp_path / "out"
        env = {**os.environ, "OUT": str(out), "PY": sys.executable, "DEVICE": "cpu", **setting}
        done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True,
                              text=True, env=env, timeout=120)  # fmt: skip
        name = next(iter(setting))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (setting, done.stderr)
        assert f"{name}=" in done.stderr or "SKIP names no check: flexx;" in done.stderr, done.stderr
        assert not out.exists()
