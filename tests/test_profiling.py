"""`trainer.profiling` writes a torch.profiler Chrome trace per rank for each chosen step, and only
those steps; the traces parse and hold the step's operators, and d9d's phase ranges (data wait,
forward+backward with a range per microbatch, optimizer, checkpoint) span what the step-time
breakdown of metrics.jsonl adds up."""

import gzip
import itertools
import json
import re

from _quickstart import overrides, records, run_local, train

PROFILE = ["trainer.profiling={start_step: 2, active_steps: 2}"]
#: The job built line's length without its run_dir path: measured 228 (the quickstart, full or tiny, one process).
JOB_BUILT_MAX = 265
#: A console line's first `key=value` field, after the label's padding.
FIRST_PAIR = re.compile(r"  (?=[a-z_]+=)")


def _trace(path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return json.load(file)


def _ranges(path) -> dict[str, list[tuple[float, float]]]:
    """d9d's ranges in a trace: name -> [(start, end)] in seconds."""
    found: dict[str, list[tuple[float, float]]] = {}
    for event in _trace(path)["traceEvents"]:
        name = event.get("name", "")
        if name.startswith("d9d.") and event.get("ph") == "X":
            start = event["ts"] / 1e6
            found.setdefault(name, []).append((start, start + event["dur"] / 1e6))
    return found


def _check_phase_ranges(path, record: dict, microbatches: int, checkpoint_s: float | None) -> None:
    """The trace of one step holds each phase once, in order, as long as the breakdown's figure (both
    are bounded by the same marks: only the clocks differ), and one range per microbatch inside the
    forward+backward one; a checkpoint step's trace holds its stall, recorded on the next step."""
    ranges = _ranges(path)
    phases = ["d9d.data", "d9d.forward_backward", "d9d.optimizer"]
    expected = {f"d9d.forward_backward.microbatch_{i}" for i in range(microbatches)} | set(phases)
    if checkpoint_s is not None:
        expected.add("d9d.checkpoint")
    assert set(ranges) == expected, sorted(ranges)
    assert all(len(spans) == 1 for spans in ranges.values()), ranges
    spans = {name: found[0] for name, found in ranges.items()}
    figures = {name: record[f"time_{name[4:]}_s"] for name in phases}
    if checkpoint_s is not None:
        phases.append("d9d.checkpoint")
        figures["d9d.checkpoint"] = checkpoint_s
    for earlier, later in itertools.pairwise(phases):
        assert spans[earlier][1] <= spans[later][0] + 1e-4, (earlier, later, spans)
    for name in phases:
        length = spans[name][1] - spans[name][0]
        # one interval on two clocks: equal but for a descheduling between a mark and its range's end
        assert abs(length - figures[name]) <= 0.1 * figures[name] + 5e-3, (name, length, figures[name])
    start, end = spans["d9d.forward_backward"]
    for i in range(microbatches):
        inner = spans[f"d9d.forward_backward.microbatch_{i}"]
        assert start - 1e-4 <= inner[0] <= inner[1] <= end + 1e-4, (i, inner, start, end)


def test_the_chosen_steps_are_traced_on_one_process(tmp_path):
    train(1, overrides(tmp_path, "one", 4, *PROFILE))
    profile = tmp_path / "one" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank-0-step-2.json.gz", "rank-0-step-3.json.gz"]
    for path in profile.iterdir():
        events = _trace(path)["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(name.startswith("aten::") for name in names), sorted(names)[:20]
        assert any("mm" in name for name in names)  # the step's matmuls are in it
    by_step = {r["step"]: r for r in records(tmp_path / "one")}
    assert list(by_step) == [1, 2, 3, 4]
    # 16 samples in microbatches of 2 on one rank; step 2 checkpoints (period 2), its stall on step 3
    _check_phase_ranges(profile / "rank-0-step-2.json.gz", by_step[2], 8, by_step[3]["time_checkpoint_s"])
    _check_phase_ranges(profile / "rank-0-step-3.json.gz", by_step[3], 8, None)


def test_every_rank_writes_its_own_trace_under_fsdp_2(tmp_path):
    profile_dir = tmp_path / "traces"
    train(2, overrides(tmp_path, "fsdp", 2, "mesh.data_parallel_shard=2",
                       f"trainer.profiling={{start_step: 1, active_steps: 1, dir: {profile_dir}}}"))  # fmt: skip
    assert sorted(p.name for p in profile_dir.iterdir()) == ["rank-0-step-1.json.gz", "rank-1-step-1.json.gz"]
    assert all(_trace(p)["traceEvents"] for p in profile_dir.iterdir())
    first = records(tmp_path / "fsdp")[0]  # rank 0's breakdown; rank 1's phases are its own
    _check_phase_ranges(profile_dir / "rank-0-step-1.json.gz", first, 4, None)  # 4 microbatches a rank
    assert {f"d9d.forward_backward.microbatch_{i}" for i in range(4)} <= set(
        _ranges(profile_dir / "rank-1-step-1.json.gz")
    )


def test_profiling_on_cpu_leaves_the_console_free_of_the_profilers_own_lines(tmp_path):
    done = run_local(overrides(tmp_path, "quiet", 2, "trainer.profiling={start_step: 2, active_steps: 1}"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "quiet" / "profile" / "rank-0-step-2.json.gz").exists()
    console = done.stdout + done.stderr
    for kineto in ("USDT:", "STAGE:", "gpuGetDeviceCount", "SyncActivityProfilerHandler"):
        assert kineto not in console, console[-2000:]
    assert "profiled step" in console
    # the rest of the console stays short and aligned too: the job built line (it was ~420 characters)
    # is 261 on the quickstart without its run_dir path (33 of them name the attention kernel), and
    # every line's fields start in one column
    (built,) = [line for line in done.stdout.splitlines() if "d9d.trainer: job built" in line]
    assert len(built) - len(str(tmp_path / "quiet")) <= JOB_BUILT_MAX, built
    columns = {m.start() for m in map(FIRST_PAIR.search, done.stdout.splitlines()) if m}
    assert len(columns) == 1, done.stdout[-3000:]
