"""`d9d plan --device-memory` on the quickstart job: a job too large for the device gets levers, and
each one printed as fitting, applied with its `--set` arguments and planned again, needs exactly the
predicted bytes, within the budget; a job that fits says so with its margin."""

import re
import shlex
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from d9d.cli import cli
from d9d.cli.commands._text import format_size
from d9d.trainer import load_job_config
from d9d.trainer.planning import FIT_HEADROOM, plan_config, plan_fit

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "config.yaml")
#: A lever as `d9d plan` prints it: whether it fits, its total per rank, its --set arguments.
_LEVER = re.compile(r"^  (fits|too big) +(\S+ \S+)  (--set .*)$")


def _plan(*args: str) -> str:
    result = CliRunner().invoke(cli, ["plan", CONFIG, *args])
    assert result.exit_code == 0, result.output
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
    device = int(plan.memory.peak_total * share / FIT_HEADROOM)  # the job needs 1/share of the budget
    fit = plan_fit(plan, loaded, device)
    assert not fit.fits and any(lever.fits for lever in fit.levers)

    out = _plan(*_sets(overrides), "--device-memory", str(device))
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
        assert (
            replanned.memory.peak_total == lever.total <= fit.budget
        )  # the same bytes, not a second estimate
        assert replanned.mesh.world_size == lever.world_size
    if share < 0.5:  # no single lever fits: the fitting ones combine several
        assert all(len(lever.overrides) > 1 for lever in fit.levers if lever.fits)


def test_a_job_that_fits_prints_one_line_with_its_margin():
    loaded = load_job_config(CONFIG)
    total = plan_config(loaded).memory.peak_total
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


def test_under_pipeline_parallelism_the_most_loaded_pp_rank_counts_and_microbatches_stay():
    overrides = ["mesh.pipeline_parallel=2"]
    loaded = load_job_config(CONFIG, overrides)
    plan = plan_config(loaded)
    memory = plan.memory
    assert memory.peak_total == memory.state.total + memory.weight_copies + max(
        memory.activations.per_pp_rank
    )
    fit = plan_fit(plan, loaded, int(memory.peak_total * 0.75 / FIT_HEADROOM))
    assert fit.total == memory.peak_total and fit.levers
    assert all("data.microbatch_size=1" not in lever.overrides for lever in fit.levers)
    for lever in fit.levers:
        if lever.fits:
            again = plan_config(load_job_config(CONFIG, [*overrides, *lever.overrides]))
            assert again.memory.peak_total == lever.total <= fit.budget


@pytest.mark.parametrize("size", ["80G", "lots", "0", "-1GiB", "12XB", "1.5B"])
def test_a_bad_device_memory_is_one_line_and_exit_2(size):
    result = CliRunner().invoke(cli, ["plan", CONFIG, "--device-memory", size])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --device-memory {size!r}") and "80GiB" in line  # and what to write
