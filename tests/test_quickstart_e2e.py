"""The quickstart job on every mesh gives the one-process run: per step the loss and the grad norm,
and at the end every weight tensor, within the measured reduction-order spread.

Ranks are forked from the test process (`_quickstart.train`); the launch through real torchrun is
covered by tests/faults/test_torchrun_restart.py (bit-identical to these forked ranks) and the CLI tests.

Measured spread (fp32, gloo, 4 steps, SGD, every mesh below, clipped and unclipped): loss
<= 1.1e-7, grad norm <= 6.5e-7, weights <= 1.2e-7 (per tensor, ||a-b|| / ||b||); AdamW on FSDP 2
the same. REL is 1e-5: ~15x that, and >= 100x below what the gradient-scale mutation at the end
moves (see there). Comparing weights found that q_norm/k_norm under tensor parallel did not sum
their gradients over tp (fixed: their input is declared sharded over the heads).
"""

import pytest
import torch
from _quickstart import MOE, NO_CLIP, SGD, compare_runs, overrides, spread, train, train_and_gather

from d9d.mesh.testing import run_distributed

pytestmark = pytest.mark.slow

STEPS = 4
REL = 1e-5
MUTATION = (
    f"providers.model={__file__.rsplit('/', 1)[0]}/_mean_reduction_provider.py:MeanReductionModelProvider"
)
MESHES = {
    "ddp2": (2, ["mesh.data_parallel_replicate=2"]),
    "fsdp2": (2, ["mesh.data_parallel_shard=2"]),
    "hsdp2x2": (4, ["mesh.data_parallel_replicate=2", "mesh.data_parallel_shard=2"]),
    "tp2": (2, ["mesh.tensor_parallel=2"]),
    "fsdp2_tp2": (4, ["mesh.data_parallel_shard=2", "mesh.tensor_parallel=2"]),
    "pp2_1f1b": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
    "pp2_gpipe_fsdp2": (
        4,
        ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2", "pipelining.schedule=gpipe"],
    ),
    "moe_ep2": (2, ["mesh.data_parallel_shard=2", "mesh.expert_parallel=2"]),
}
#: The job variants every mesh runs. SGD keeps the spread at ~1e-7; "clipped" keeps the quickstart's
#: max_norm 1.0, which every step's norm (1.9-2.9) exceeds, so it tests the distributed clipping;
#: "unclipped" lets a gradient-scale error reach the loss, not only the logged norm, and carries SGD
#: momentum state into the final checkpoint (a Partial norm-weight gradient under TP made its save fail).
VARIANTS = {"clipped": SGD, "unclipped": [*SGD, "optimizer.momentum=0.5", *NO_CLIP]}
#: Every run writes its final checkpoint only (always written): the compared weights are gathered from
#: the model, and a checkpoint at step 2 too would only add a save per run.
LAST_SAVE = ["trainer.checkpointing.period_steps=0"]


def _model(mesh: str) -> list[str]:
    return MOE if mesh.startswith("moe") else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)

    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def reference(runs):
    """The one-process run of a (model, variant) job, trained once per module."""
    cache = {}

    def get(model: tuple[str, ...], variant: tuple[str, ...]):
        key = (model, variant)
        if key not in cache:
            name = f"single{len(cache)}"
            cache[key] = train(1, overrides(runs, name, STEPS, *LAST_SAVE, *model, *variant))
            losses = [r["loss"] for r in cache[key].records]
            assert len(losses) == STEPS and losses[-1] < losses[0]
        return cache[key]

    return get


@pytest.fixture(scope="module")
def mesh_run(runs):
    """The run of a mesh and variant, trained once per module (the TP weights test reuses it)."""
    cache = {}

    def get(mesh: str, variant: str):
        if (mesh, variant) not in cache:
            nproc, degrees = MESHES[mesh]
            job = [*_model(mesh), *VARIANTS[variant], *degrees]
            cache[mesh, variant] = train(nproc, overrides(runs, f"{mesh}-{variant}", STEPS, *LAST_SAVE, *job))
        return cache[mesh, variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_gives_single_process_losses_grad_norms_and_weights(reference, mesh_run, mesh, variant):
    expected = reference(tuple(_model(mesh)), tuple(VARIANTS[variant]))
    compare_runs(mesh_run(mesh, variant), expected, rel=REL)


def test_tensor_parallel_keeps_qk_norm_replicas_equal(runs):
    """Per-head norms under tensor parallel (each rank normalizes its own heads): their weight
    gradients are summed over tp, so after training both tp ranks hold the same q/k norms."""
    args = overrides(runs, "tp2-replicas", 2, *LAST_SAVE, *SGD, "mesh.tensor_parallel=2")
    rank0, rank1 = run_distributed(train_and_gather, 2, args, timeout=300)
    differ = [name for name in rank0 if not torch.equal(rank0[name], rank1[name])]
    assert not differ, f"tp ranks hold different replicas of {differ}"


def test_comparison_catches_gradients_averaged_instead_of_summed(runs, reference):
    """Mutation check: FSDP 2 with gradient_reduction="mean" halves every gradient. The comparison
    the tests above use must fail on it, in the grad norm and, with clipping out of reach, the loss.

    Measured: grad norm off by 0.50 from step 1, loss by ~1e-1 at step 4, weights by ~0.6; with
    clipping and AdamW (both scale-invariant) the loss moves only ~1e-4/3e-7, hence the grad norms.
    """
    expected = reference((), tuple(VARIANTS["unclipped"]))
    broken = train(
        2,
        overrides(
            runs,
            "fsdp2-mean",
            STEPS,
            *LAST_SAVE,
            *VARIANTS["unclipped"],
            "mesh.data_parallel_shard=2",
            MUTATION,
        ),
    )
    with pytest.raises(AssertionError, match="grad_norm off") as caught:
        compare_runs(broken, expected, rel=REL)
    assert "loss off" in str(caught.value) and "weight" in str(caught.value)
    found = spread(broken, expected)
    assert found.grad_norm > 0.4 and found.loss > 100 * REL and found.weights > 100 * REL, found
