"""Float8 linears through the trainer (`trainer.precision.float8`): one process equals FSDP 2 (whose
tensorwise weights are all-gathered in float8) in losses, grad norms and weights; a checkpoint holds
the float32 weights, so a run resumes with float8 turned on or off and loads exactly what was saved;
float8 works with activation checkpointing and compile (one graph per block, the eager numbers);
`d9d plan` lists the converted linears and keeps the output layer; under FSDP the weights' float8
scales are computed once per step for all of them (`d9d.parallel.precompute_float8_scales`), not at
each all-gather, with the same numbers.

What CPU cannot show (float8 speed, the GPU's float8 kernels) is the GPU check's; the loss gap to
float32 over 50 quickstart steps is measured in benchmarks/float8.py. Bad float8 sections are cases of
the bad-input corpus (tests/bad_input/cases.yaml)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import (
    CONFIG,
    TINY,
    compare_runs,
    overrides,
    run_forked,
    spread,
    train,
    train_counting_float8_scales,
)

from d9d.mesh.testing import run_distributed

pytest.importorskip("torchao", reason="torchao (d9d-parallel's float8 extra) is not installed")

F8 = ["trainer.precision.float8={recipe: tensorwise}"]
#: Every run here, float8 or not, takes 4 sequences a step (2 microbatches of 2 on one process, 1 per
#: rank on FSDP 2): torch's CPU `_scaled_mm` is a reference kernel (measured 17 ms for 128x64x64, ~600x
#: a float32 matmul), so the quickstart's 16 sequences cost seconds per float8 step.
BATCH = ["data.global_batch_size=4"]
STEPS = 2


def _job(save_dir: Path, name: str, steps: int, *extra: str) -> list[str]:
    return overrides(save_dir, name, steps, *BATCH, *extra)


def test_float8_on_one_process_equals_fsdp_2_and_stays_near_float32(tmp_path):
    one = train(1, _job(tmp_path, "one", 3, *F8))
    fsdp = train(2, _job(tmp_path, "fsdp", 3, "mesh.data_parallel_shard=2", *F8))
    plain = train(1, _job(tmp_path, "plain", 3))
    gap = spread(one, plain)
    assert 0 < gap.loss < 1e-2, gap  # float8 rounding changes the numbers, a little (measured 3.5e-4)
    # FSDP sums the same float8 products in another order; e5m2 gradients (2 mantissa bits) can turn
    # last-bit differences into visible ones (measured at 16 sequences a step: loss 3e-6, grad norm
    # 4.4e-4, weights 3.4e-3; at 4: 5e-8, 2e-7, 4e-8 against float8's own 3.5e-4, 4.4e-3, 3.7e-2 after
    # 3 AdamW steps), a fifth or less of what float8 itself changes
    found = compare_runs(fsdp, one, rel=1e-3, weights_rel=1e-2)
    assert found.grad_norm < gap.grad_norm / 5 and found.weights < gap.weights / 5, (found, gap)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == torch.float32 for k in a)


def test_a_checkpoint_holds_the_float32_weights_and_a_run_resumes_with_float8_on_or_off(tmp_path):
    saved_on = train(1, _job(tmp_path, "f8on", 2, *F8))  # its checkpoint at step 2
    assert _same(train(1, _job(tmp_path, "f8on", 2)).weights, saved_on.weights)  # loaded without float8
    saved_off = train(1, _job(tmp_path, "f8off", 2))
    assert _same(train(1, _job(tmp_path, "f8off", 2, *F8)).weights, saved_off.weights)  # loaded into float8
    going_on = train(1, _job(tmp_path, "f8off", 3, *F8))  # and it trains on from there
    assert [r["step"] for r in going_on.records] == [1, 2, 3]
    assert torch.isfinite(torch.tensor(going_on.records[-1]["loss"]))


def _run(save_dir: str, compile_on: bool, checkpointing: str) -> tuple[dict[str, int], list[float]]:
    """Dynamo's graph and break counts and the losses of a 6-step float8 quickstart run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from d9d.trainer import Trainer

    torch._dynamo.reset()
    counters.clear()
    sets = [*TINY, *BATCH, *F8, f"trainer.compile.enabled={str(compile_on).lower()}",
            f"trainer.activation_checkpointing.mode={checkpointing}", f"trainer.checkpointing.save_dir={save_dir}",
            "trainer.schedule.total_steps=6", "trainer.checkpointing.period_steps=0"]  # fmt: skip
    with Trainer.from_config(CONFIG, sets) as trainer:
        losses = trainer.train().losses
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
    }, losses


def test_float8_with_activation_checkpointing_and_compile_keeps_one_graph_per_block_and_the_eager_numbers(
    tmp_path,
):
    eager = run_forked(_run, str(tmp_path / "e"), False, "none", timeout=400)[1]
    checkpointed = run_forked(_run, str(tmp_path / "a"), False, "full", timeout=400)[1]
    assert checkpointed == eager  # recomputing a float8 block recomputes the same float8 casts
    graphs, compiled = run_forked(_run, str(tmp_path / "c"), True, "full", timeout=400)
    assert graphs["breaks"] == 0 and 1 <= graphs["graphs"] <= 2, (
        graphs
    )  # 2 blocks of one shape: no recompiles
    # inductor rounds differently, and float8 casts make that visible (measured 9.7e-5 by step 6)
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager, strict=True)) < 1e-3


def test_d9d_plan_lists_the_linears_float8_converts_and_keeps():
    import yaml
    from click.testing import CliRunner

    from d9d.cli import cli

    layers = yaml.safe_load(Path(CONFIG).read_text())["model"]["num_layers"]
    result = CliRunner().invoke(cli, ["plan", str(CONFIG), "--world-size", "2", "--set", "mesh.data_parallel_shard=2",
                                      "--set", "trainer.precision.float8={}"])  # fmt: skip
    assert result.exit_code == 0, result.output
    # q, k, v, o and gate, up, down of every layer; the output layer stays bf16 (not named in modules)
    linears = ", ".join(f"model.layers.*.{p} ×{layers}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))  # fmt: skip
    line = f"float8: tensorwise: {7 * layers} linears ({linears}); kept: lm_head (output layer); FSDP all-gathers"
    assert line in result.output, result.output


def test_under_fsdp_float8_scales_are_computed_once_per_step_for_every_weight_and_no_number_changes(tmp_path):
    sets = [
        *TINY,
        *F8,
        "data.global_batch_size=8",
        "mesh.data_parallel_shard=2",
        f"trainer.schedule.total_steps={STEPS}",
    ]
    before = run_distributed(train_counting_float8_scales, 2, str(tmp_path / "b"), sets, False, timeout=300)
    now = run_distributed(train_counting_float8_scales, 2, str(tmp_path / "n"), sets, True, timeout=300)
    for rank_before, rank_now in zip(before, now, strict=True):
        weights = rank_now["gathered"]
        assert weights == 14  # 7 linears in each of the 2 layers; lm_head stays bf16
        # before: each weight's amax at each all-gather: 2 microbatches' forwards and backwards a step
        assert rank_before["per_weight"] == STEPS * 2 * 2 * weights and not rank_before["all_weights"]
        # now: none per weight; one reduction of all of them before the first step and after each update
        assert rank_now["per_weight"] == 0 and rank_now["all_weights"] == [weights] * (STEPS + 1)
        assert rank_now["losses"] == rank_before["losses"]  # the same scales: the same numbers
        assert all(torch.equal(w, rank_before["weights"][n]) for n, w in rank_now["weights"].items())
