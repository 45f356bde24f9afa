"""`d9d plan --device-memory` on the quickstart job: a job too large for the device gets levers and
exit status 3, and each one printed as fitting, applied with its `--set` arguments and planned again,
needs exactly the predicted bytes, within the budget; a job that fits says so with its margin and
exits 0. Under pipeline parallelism the total is the pp rank that needs the most, named."""

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from d9d.cli import cli
from d9d.cli.commands._text import format_size
from d9d.cli.commands.plan import EXIT_DOES_NOT_FIT
from d9d.mesh import DistributedContext
from d9d.trainer import load_job_config, resolve_job
from d9d.trainer.planning import FIT_HEADROOM, plan_config, plan_fit, plan_job
from d9d.trainer.providers import InitializeModelStageContext

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "config.yaml")
#: A lever as `d9d plan` prints it: whether it fits, its total per rank, its --set arguments.
_LEVER = re.compile(r"^  (fits|too big) +(\S+ \S+)  (--set .*)$")


def _plan(*args: str, status: int = 0) -> str:
    result = CliRunner().invoke(cli, ["plan", CONFIG, *args])
    assert result.exit_code == status, result.output
    assert result.stderr == "", result.stderr  # a plan that does not fit is no error: all of it on stdout
    return result.output


def _sets(overrides: list[str] | tuple[str, ...]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _printed_levers(output: str) -> list[tuple[bool, str, str]]:
    return [(m[1] == "fits", m[2], m[3]) for line in output.splitlines() if (m := _LEVER.match(line))]


@pytest.mark.parametrize(
    ("overrides", "share"),
    [([], 0.75), ([], 0.25), (["mesh.data_parallel_replicate=2"], 0.75)],
    ids=["single-levers", "combinations", "replicated"],
)
def test_each_lever_that_fits_plans_again_to_its_predicted_total(overrides, share):
    loaded = load_job_config(CONFIG, overrides)
    plan = plan_config(loaded)
    device = int(plan.memory.total * share / FIT_HEADROOM)  # the job needs 1/share of the budget
    fit = plan_fit(plan, loaded, device)
    assert not fit.fits and any(lever.fits for lever in fit.levers)

    out = _plan(*_sets(overrides), "--device-memory", str(device), status=EXIT_DOES_NOT_FIT)
    assert f"does not fit: {format_size(fit.total)} per rank, {format_size(-fit.margin)} over" in out
    printed = _printed_levers(out)
    assert printed == [(lever.fits, format_size(lever.total), lever.arguments) for lever in fit.levers]
    for fits, size, arguments in printed:
        if not fits:
            continue
        (lever,) = [lever for lever in fit.levers if lever.arguments == arguments]
        # as a user runs it: the printed --set arguments after the job's own
        again = _plan(*_sets(overrides), *shlex.split(arguments), "--device-memory", str(device))
        (line,) = [line for line in again.splitlines() if line.startswith(("fits:", "does not fit:"))]
        assert line.startswith(f"fits: {size} per rank of {format_size(fit.budget)}"), line
        replanned = plan_config(load_job_config(CONFIG, [*overrides, *lever.overrides]))
        assert replanned.memory.total == lever.total <= fit.budget  # the same bytes, not a second estimate
        assert replanned.mesh.world_size == lever.world_size
    if share < 0.5:  # no single lever fits: the fitting ones combine several
        assert all(len(lever.overrides) > 1 for lever in fit.levers if lever.fits)


def test_a_job_that_fits_prints_one_line_with_its_margin():
    loaded = load_job_config(CONFIG)
    total = plan_config(loaded).memory.total
    out = _plan("--device-memory", "80GiB")
    budget = int(80 * 2**30 * FIT_HEADROOM)
    fit_lines = [line for line in out.splitlines() if line.startswith(("fits", "does not fit", "  fits"))]
    assert fit_lines == [
        f"fits: {format_size(total)} per rank of {format_size(budget)} (90% of 80.0 GiB, --device-memory), "
        f"{format_size(budget - total)} to spare"
    ]


def test_without_device_memory_it_uses_the_local_gpu_or_says_to_pass_it():
    out = _plan()
    if torch.cuda.is_available():
        assert f"the local GPU, {torch.cuda.get_device_name()}" in out
    else:
        (hint,) = [line for line in out.splitlines() if "--device-memory" in line]
        assert hint.startswith("fit: pass --device-memory SIZE")


#: The quickstart on 2 pipeline stages with a vocabulary of 8192 and the loss on full logits: the last
#: stage holds the head (8192 × 128) and the logits, so it needs more than stage 0, although 1F1B keeps
#: two microbatches in flight on stage 0 and one on stage 1.
LAST_STAGE_HEAVY = ["mesh.pipeline_parallel=2", "model.vocab_size=8192", "trainer.loss.fused=false"]


def _own_figures(loaded: Any, pp_rank: int, ranks: tuple[int, ...]) -> int:
    """What a rank of `pp_rank` needs, from its own parts: the parameters its model provider builds
    for its stages (float32: weights, gradients, AdamW's two states; bf16 copies of the weights
    but the embedding table) and the activations its own plan
    counts (checked against real runs in test_plan_activations.py)."""
    job = resolve_job(loaded)
    with DistributedContext.for_planning(job.config.mesh, rank=ranks[0]) as ctx:
        own = plan_job(job, ctx, device="cuda", memory=True)
        assert own.pipeline is not None and own.memory is not None and own.memory.activations is not None
        numel = copies = 0
        for stage in own.pipeline.stages:
            assert stage.rank == pp_rank
            with torch.device("meta"):
                context = InitializeModelStageContext(
                    context=ctx, stage_index=stage.index, num_stages=stage.num_stages, stage=stage
                )
                model = job.model_provider.initialize_model_stage(context).model
            numel += sum(p.numel() for p in model.parameters())
            # bf16 compute (the plan's device is CUDA): every weight but the embedding table is cast once
            # per step and kept (the norm scales counted too: an upper bound)
            tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
            copies += (sum(p.numel() for p in model.parameters()) - tables) * 2
    return numel * 4 * (1 + 1 + 2) + copies + own.memory.activations.checkpointed


def test_a_pipeline_plans_total_is_its_most_loaded_pp_ranks_and_the_plan_names_it():
    loaded = load_job_config(CONFIG, LAST_STAGE_HEAVY)
    plan = plan_config(loaded)
    memory = plan.memory
    needs = [_own_figures(loaded, r, ranks) for r, ranks in enumerate(plan.pipeline.pp_ranks)]
    assert needs[1] > needs[0]  # the job this test is about: the last stage needs the most
    assert [r.total for r in memory.pp_ranks] == needs
    assert memory.total == max(needs) and memory.peak.pp_rank == 1
    stage_0_figure = memory.state.total + memory.activations.checkpointed  # what `total` said before
    assert stage_0_figure < memory.total

    # a device between the two: a stage-0 figure fits it, the most loaded rank does not
    device = int((stage_0_figure + memory.total) / 2 / FIT_HEADROOM)
    out = _plan(*_sets(LAST_STAGE_HEAVY), "--device-memory", str(device), status=EXIT_DOES_NOT_FIT)
    assert f"does not fit: {format_size(max(needs))} per rank" in out
    (header,) = [line for line in out.splitlines() if line.startswith("memory per rank")]
    assert "pp rank 1, which needs the most: stage 1: layers 2..3 + head" in header
    assert f"  total       {format_size(max(needs)):>10}  (pp rank 1, the most of any rank)" in out
    (per_rank,) = [line for line in out.splitlines() if line.startswith("  total per pp rank")]
    assert per_rank.endswith(
        f"pp rank 0: {format_size(needs[0])} (stage 0), pp rank 1: {format_size(needs[1])} (stage 1)"
    )


def test_under_pipeline_parallelism_levers_replan_to_their_totals_and_microbatches_stay():
    overrides = ["mesh.pipeline_parallel=2"]
    loaded = load_job_config(CONFIG, overrides)
    plan = plan_config(loaded)
    memory = plan.memory
    assert memory.total == max(rank.total for rank in memory.pp_ranks)
    fit = plan_fit(plan, loaded, int(memory.total * 0.75 / FIT_HEADROOM))
    assert fit.total == memory.total and fit.levers
    assert all("data.microbatch_size=1" not in lever.overrides for lever in fit.levers)
    for lever in fit.levers:
        if lever.fits:
            again = plan_config(load_job_config(CONFIG, [*overrides, *lever.overrides]))
            assert again.memory.total == lever.total <= fit.budget


@pytest.mark.parametrize("size", ["80G", "lots", "0", "-1GiB", "12XB", "1.5B"])
def test_a_bad_device_memory_is_one_line_and_exit_2(size):
    result = CliRunner().invoke(cli, ["plan", CONFIG, "--device-memory", size])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --device-memory {size!r}") and "80GiB" in line  # and what to write
