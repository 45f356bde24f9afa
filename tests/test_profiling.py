"""`trainer.profiling` writes a torch.profiler Chrome trace per rank for each chosen step, and only
those steps; the traces parse and hold the step's operators."""

import gzip
import json
import re

from _quickstart import overrides, records, run_local, train

PROFILE = ["trainer.profiling={start_step: 2, active_steps: 2}"]
#: The job built line's length without its run_dir path: measured 228 (the quickstart, full or tiny, one process).
JOB_BUILT_MAX = 240
#: A console line's first `key=value` field, after the label's padding.
FIRST_PAIR = re.compile(r"  (?=[a-z_]+=)")


def _trace(path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return json.load(file)


def test_the_chosen_steps_are_traced_on_one_process(tmp_path):
    train(1, overrides(tmp_path, "one", 4, *PROFILE))
    profile = tmp_path / "one" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank-0-step-2.json.gz", "rank-0-step-3.json.gz"]
    for path in profile.iterdir():
        events = _trace(path)["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(name.startswith("aten::") for name in names), sorted(names)[:20]
        assert any("mm" in name for name in names)  # the step's matmuls are in it
    assert [r["step"] for r in records(tmp_path / "one")] == [1, 2, 3, 4]


def test_every_rank_writes_its_own_trace_under_fsdp_2(tmp_path):
    profile_dir = tmp_path / "traces"
    train(2, overrides(tmp_path, "fsdp", 2, "mesh.data_parallel_shard=2",
                       f"trainer.profiling={{start_step: 1, active_steps: 1, dir: {profile_dir}}}"))  # fmt: skip
    assert sorted(p.name for p in profile_dir.iterdir()) == ["rank-0-step-1.json.gz", "rank-1-step-1.json.gz"]
    assert all(_trace(p)["traceEvents"] for p in profile_dir.iterdir())


def test_profiling_on_cpu_leaves_the_console_free_of_the_profilers_own_lines(tmp_path):
    done = run_local(overrides(tmp_path, "quiet", 2, "trainer.profiling={start_step: 2, active_steps: 1}"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "quiet" / "profile" / "rank-0-step-2.json.gz").exists()
    console = done.stdout + done.stderr
    for kineto in ("USDT:", "STAGE:", "gpuGetDeviceCount", "SyncActivityProfilerHandler"):
        assert kineto not in console, console[-2000:]
    assert "profiled step" in console
    # the rest of the console stays short and aligned too: the job built line (it was ~420 characters)
    # is 228 on the quickstart without its run_dir path, and every line's fields start in one column
    (built,) = [line for line in done.stdout.splitlines() if "d9d.trainer: job built" in line]
    assert len(built) - len(str(tmp_path / "quiet")) <= JOB_BUILT_MAX, built
    columns = {m.start() for m in map(FIRST_PAIR.search, done.stdout.splitlines()) if m}
    assert len(columns) == 1, done.stdout[-3000:]
