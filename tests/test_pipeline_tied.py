"""Tied embeddings (`model.tie_word_embeddings: true`) under pipeline parallelism equal one process.

The first stage holds the embedding, the last stage the head (on the V schedules both on one rank):
`d9d.parallel.pipeline.Pipeline` keeps the copies one parameter (summed gradients, the norm counted once),
the checkpoint holds the one-process keys (so it resumes across pp 2 ↔ 1) and the export writes the
table once, as one process does. Ranks are forked from this process (`_quickstart.train`); SGD
without clipping, fp32, 4 layers, 4 microbatches of 2.

Measured spread against one process (4 steps): loss <= 7.0e-8, grad norm <= 8.7e-7, weights <=
4.0e-7 (1f1b, zbv, 1f1b × FSDP 2, zbv × FSDP 2); REL is 1e-5 as the issue asks.
"""

import shutil

import pytest
import torch
from _quickstart import NO_CLIP, SGD, compare_runs, exported_weights, overrides, run_forked, train

REL = 1e-5
STEPS = 4
SHAPE = [
    "model.num_layers=4",
    "data.global_batch_size=8",
    "data.microbatch_size=2",
    "model.tie_word_embeddings=true",
]
PP2 = ["mesh.pipeline_parallel=2"]


@pytest.fixture(scope="module", autouse=True)
def _imported():
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)


def _args(tmp_path, name, steps, *extra):
    return overrides(tmp_path, name, steps, *SGD, *NO_CLIP, *SHAPE, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted one-process run (checkpoints every 2 steps)."""
    tmp = tmp_path_factory.mktemp("tied-reference")
    return train(1, _args(tmp, "one", STEPS))


@pytest.mark.parametrize(
    ("name", "nproc", "extra"),
    [
        ("1f1b", 2, ["pipelining.schedule=1f1b"]),
        ("zbv", 2, ["pipelining.schedule=zbv"]),  # embedding and head on the same rank
        ("1f1b-fsdp2", 4, ["pipelining.schedule=1f1b", "mesh.data_parallel_shard=2"]),
        ("zbv-fsdp2", 4, ["pipelining.schedule=zbv", "mesh.data_parallel_shard=2"]),
    ],
)
def test_tied_embeddings_across_stages_equal_one_process(tmp_path, reference, name, nproc, extra):
    got = train(nproc, _args(tmp_path, name, STEPS, *PP2, *extra))
    compare_runs(got, reference, rel=REL)
    assert torch.equal(got.weights["lm_head.weight"], got.weights["model.embed_tokens.weight"])


def _cli_export(run_dir, out):
    from d9d.cli._group import cli

    cli.main(["export", str(run_dir), "--out", str(out)], prog_name="d9d", standalone_mode=False)


def _assert_export_equals_one_process(run_dir, exported):
    """`Trainer.export()` on the pp mesh wrote the files `d9d export` writes from the run's last
    checkpoint in one process: the table once (`model.embed_tokens.weight`), as HF stores it."""
    reference = run_dir.parent / f"{run_dir.name}-one-process-export"
    run_forked(_cli_export, run_dir, reference, timeout=120)
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in exported.iterdir()) == names
    for name in names:
        assert (exported / name).read_bytes() == (reference / name).read_bytes(), name
    weights = exported_weights(exported)
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" not in weights


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((2, [*PP2, "pipelining.schedule=1f1b"]), (1, [])),
        ((1, []), (2, [*PP2, "pipelining.schedule=zbv"])),
    ],
    ids=["pp2-1f1b-to-pp1", "pp1-to-pp2-zbv"],
)
def test_a_tied_checkpoint_resumes_across_pipeline_degrees_and_exports(tmp_path, reference, saved, resumed):
    """Saved at step 2 on one layout, continued to step 4 on the other: the continued steps and the
    final weights equal an uninterrupted one-process run. The pp run exports (at step 2 or 4) the
    bytes a one-process export of its checkpoint writes."""
    pipelined = saved if saved[0] > 1 else resumed
    export = [f"export.dir={tmp_path / 'exported'}"]
    train(saved[0], _args(tmp_path, "saved", 2, *saved[1], *(export if saved is pipelined else [])))
    shutil.copytree(tmp_path / "saved", tmp_path / "resumed")
    got = train(
        resumed[0], _args(tmp_path, "resumed", 4, *resumed[1], *(export if resumed is pipelined else []))
    )
    compare_runs(got, reference, rel=REL, steps=range(3, 5))
    compare_runs(got, reference, rel=REL)
    _assert_export_equals_one_process(
        tmp_path / ("saved" if saved is pipelined else "resumed"), tmp_path / "exported"
    )
