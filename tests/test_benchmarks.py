"""Benchmarks that must not rot: their small CPU modes run here (their figures are not asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, script: str, *args: str, timeout: int) -> tuple[str, list[dict]]:
    """Run benchmarks/<script> with `--json`; its stdout and its rows (fails on a non-zero exit)."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_gpu_throughput_tiny_mode_runs_every_cpu_phase(tmp_path):
    stdout, rows = _run(tmp_path, "gpu_throughput.py", "--tiny", timeout=600)
    for phase in ("bf16", "bf16+full-ac", "plain-bf16"):
        assert any(line.startswith(phase + " ") for line in stdout.splitlines()), (phase, stdout)
    assert [r["name"] for r in rows] == ["gpu step: d9d bf16 / plain bf16 loop"]
    assert rows[0]["ratio"] > 0


def test_context_parallel_small_mode_counts_every_part_at_cp_1_2_4(tmp_path):
    stdout, rows = _run(
        tmp_path, "context_parallel.py", "--seq", "64", "--cp", "1", "2", "4", "--repeats", "1", "--warmup", "0",
        timeout=300,
    )  # fmt: skip
    table = [cells for cells in map(str.split, stdout.splitlines()) if cells and cells[0].isdigit()]
    assert [(cells[0], cells[1]) for cells in table] == [("64", "1"), ("64", "2"), ("64", "4")], stdout
    assert len(rows) == 8 and all(r["ratio"] > 0 for r in rows), rows


def test_cp_balance_quick_mode_measures_every_scenario_before_and_after(tmp_path):
    stdout, rows = _run(tmp_path, "cp_balance.py", "--quick", "--cp", "2", "4", timeout=300)
    assert "long 1/2" in stdout, stdout
    assert len(rows) == 3 * 2 * 2 * 2, rows  # scenarios x cp x rows per microbatch x before/after
    assert all(r["ratio"] >= 1.0 for r in rows), rows


def test_lora_memory_tiny_mode_counts_grads_and_state_for_adapters_only(tmp_path):
    stdout, rows = _run(tmp_path, "lora_memory.py", "--tiny", timeout=300)  # it asserts: adapters only
    for label in ("gradient bytes", "optimizer state bytes", "trainable parameters"):
        assert any(line.startswith(label + " ") for line in stdout.splitlines()), (label, stdout)
    assert [r["name"] for r in rows] == [
        "LoRA / full: gradient bytes",
        "LoRA / full: optimizer state bytes",
        "LoRA / full: parameter bytes",
        "LoRA / full: checkpoint bytes",
    ]
    assert 0 < rows[0]["ratio"] < 1 and 0 < rows[1]["ratio"] < 1 and 0 < rows[3]["ratio"] < 1, rows


def test_cpu_offload_small_mode_splits_the_state_bytes_by_lever(tmp_path):
    stdout, rows = _run(
        tmp_path, "cpu_offload.py", "--steps", "4", "--rounds", "1", "--layers", "1", "--hidden", "64", timeout=300
    )  # fmt: skip
    assert "step time, FSDP 2 with / without offload" in stdout
    got = {r["name"].removeprefix("cpu offload: "): r["ratio"] for r in rows}
    assert list(got) == [
        "1 process, device state bytes/rank / 1 process",
        "1 process, host state bytes/rank / 1 process",
        "FSDP 2, device state bytes/rank / 1 process",
        "FSDP 2, host state bytes/rank / 1 process",
        "FSDP 2 + cpu_offload, device state bytes/rank / 1 process",
        "FSDP 2 + cpu_offload, host state bytes/rank / 1 process",
        "FSDP 2 step time with / without (CPU)",
    ]
    # offload moves exactly what FSDP 2 keeps on the device to the host, and leaves nothing there
    assert got["FSDP 2 + cpu_offload, device state bytes/rank / 1 process"] == 0
    assert (
        got["FSDP 2 + cpu_offload, host state bytes/rank / 1 process"]
        == got["FSDP 2, device state bytes/rank / 1 process"]
    )


def test_moe_tiny_mode_times_both_banks_and_counts_host_reads(tmp_path):
    stdout, rows = _run(tmp_path, "moe.py", "--tiny", timeout=300)
    assert "grouped/loop" in stdout
    reads = {r["name"]: r["ratio"] for r in rows if "host reads" in r["name"]}
    assert reads == {
        "moe host reads per layer, 1 process, 8 experts": 0.0,
        "moe host reads per layer, EP 2, 8 experts": 1.0,
    }


def test_hf_backend_tiny_mode_times_both_backends_and_measures_both_imports(tmp_path):
    stdout, rows = _run(tmp_path, "hf_backend.py", "--tiny", timeout=600)
    for label in (
        "  HF backend ",
        "  HF backend FSDP 2, peak extra per rank",
        "  transformers from_pretrained",
    ):
        assert any(line.startswith(label) for line in stdout.splitlines()), (label, stdout)
    assert [r["name"] for r in rows] == [
        "HF backend / reference model step time",
        "HF import, FSDP 2: peak per rank / model size",
        "HF import, FSDP 2: peak per rank / from_pretrained peak",
        "HF import, FSDP 2: reading the folder, peak per rank / model size",
        "HF import, FSDP 2: peak per rank without the mapped file pages / model size",
    ]
    assert all(r["ratio"] > 0 for r in rows), rows


def test_optimizer_states_tiny_mode_counts_half_the_state_bytes_on_one_process_and_fsdp_2(tmp_path):
    stdout, rows = _run(tmp_path, "optimizer_states.py", "--tiny", "--repeats", "3", timeout=300)
    assert "loss after 4 steps" in stdout and "optimizer.step() alone" in stdout, stdout
    ratios = {r["name"]: r["ratio"] for r in rows}
    counted = [name for name in ratios if name.startswith("bf16 / fp32 optimizer state bytes")]
    assert len(counted) == 3 and all(ratios[name] == 0.5 for name in counted), ratios  # exact counts
    assert ratios["bf16 states: d9d plan's optimizer estimate / counted, one process"] == 1.0
    assert all(r["ratio"] >= 0 for r in rows), rows


def test_activation_checkpointing_tiny_mode_counts_bytes_ops_and_flops_per_mode(tmp_path):
    stdout, rows = _run(tmp_path, "activation_checkpointing.py", "--tiny", timeout=300)
    for mode in ("none", "full", "op"):
        assert sum(line.startswith(mode + " ") for line in stdout.splitlines()) == 2, (mode, stdout)
    got = {r["name"]: r["ratio"] for r in rows}
    assert list(got) == [
        "AC full: saved bytes per block / none (CPU fp32)",
        "AC op: saved bytes per block / none (CPU fp32)",
        "AC full: CPU step time / none",
        "AC op: CPU step time / none",
        "AC full: saved bytes per block / none (8B shape, bf16)",
        "AC full: recompute FLOPs / none's step (8B shape)",
        "AC op: saved bytes per block / none (8B shape, bf16)",
        "AC op: recompute FLOPs / none's step (8B shape)",
    ]
    assert got["AC op: recompute FLOPs / none's step (8B shape)"] == 0
    assert got["AC full: recompute FLOPs / none's step (8B shape)"] > 0.2


#: The GPU check's checks its CI dry run leaves out, for time (about a minute per torch version, most of
#: it a Python start per check): the compiled ones (tp_compile, tp_float8, fsdp_compiled, moe_compile:
#: 20-60 s each; the MoE bank's compile has its unit tests), tp_full_ac (tp_bf16's path with one setting
#: more), the quickstart (train.py and its resume: the e2e tests), and dtypes, cp_attention and
#: cpu_offload, whose subjects d9d-parallel's tests cover (test_precision, test_context_parallel,
#: test_cpu_offload). `DEVICE=cpu bash benchmarks/gpu_check.sh` runs them all.
DRY_RUN_LEAVES_OUT = ("tp_compile", "tp_float8", "tp_full_ac", "quickstart", "dtypes", "cp_attention",
                      "cpu_offload", "fsdp_compiled", "moe_compile")  # fmt: skip


def test_gpu_check_dry_run_on_cpu_passes_every_check_it_runs(tmp_path):
    # The GPU check's DEVICE=cpu mode: the same script and checks at tiny shapes, with the Python running
    # this test (.ci/torch_compat runs it under torch 2.11, the GPU machine's torch).
    out = tmp_path / "out"
    env = dict(
        os.environ, OUT=str(out), DEVICE="cpu", PY=sys.executable, OMP_NUM_THREADS="1",
        SKIP=" ".join(DRY_RUN_LEAVES_OUT),
    )  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    summary = (out / "summary.txt").read_text().splitlines()
    results = {line.split()[1]: line.split()[2] for line in summary if line.startswith("RESULT ")}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    ran = {name for name in results if name not in DRY_RUN_LEAVES_OUT}
    assert {"env", "tp_plain", "tp_bf16", "moe", "syncs", "flex_docmask", "fsdp"} <= ran, summary
    # env reports versions; every other check passes
    assert {name: results[name] for name in ran} == {
        name: "INFO" if name == "env" else "PASS" for name in ran
    }, summary
    assert {results[name] for name in DRY_RUN_LEAVES_OUT} == {"SKIP"}, summary
    # each check printed its own line, with its figures (not one the runner made from its exit status)
    assert all(len(line.split()) > 4 for line in summary if line.split()[1] in ran), summary
    assert (out / "logs.tgz").is_file()


def test_fused_loss_tiny_mode_measures_both_paths(tmp_path):
    stdout, rows = _run(tmp_path, "fused_loss.py", "--tiny", timeout=300)
    assert "fused / full: peak" in stdout
    got = {r["name"]: r["ratio"] for r in rows}
    assert list(got) == [
        "fused / full loss: peak bytes of the loss step",
        "fused / full loss: peak bytes above the weight gradient",
        "fused / full loss: step time (CPU)",
    ]
    assert 0 < got["fused / full loss: peak bytes of the loss step"] < 0.5, rows  # 256 tokens, chunks of 32


def test_plan_activations_one_mesh_prints_every_dtype_and_mode_and_a_ratio(tmp_path):
    stdout, rows = _run(tmp_path, "plan_activations.py", "--meshes", "1 process", timeout=300)
    lines = [line for line in stdout.splitlines() if line.startswith("1 process")]
    assert len(lines) == 6, stdout  # float32 and bfloat16 × none, full, op
    (only,) = rows
    assert only["name"].endswith("1 process") and abs(only["ratio"] - 1) < 1e-3, only


def test_rl_vs_trl_runs_both_trainers_for_a_few_steps(tmp_path):
    stdout, rows = _run(tmp_path, "rl_vs_trl.py", "--steps", "2", timeout=600)
    assert "first 2 steps: d9d" in stdout and "TRL" in stdout, stdout[-2000:]
    assert [r["name"] for r in rows] == ["grpo reward, last steps: d9d / TRL"] and rows[0]["ratio"] >= 0
