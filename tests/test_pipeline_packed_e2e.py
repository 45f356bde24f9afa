"""Packed rows under pipeline parallelism: every stage gets the microbatch's document ids and
positions (`CausalLMTask.pipeline_kwargs`), so every schedule trains the quickstart model on packed
documents exactly as one process does.

The rows (`_packed_rows_provider`) hold documents of skewed lengths laid end to end: documents cross
row and microbatch boundaries, start exactly at a row's start and span whole rows (checked below).
Ranks are forked from this process (`_quickstart.train`). SGD without clipping, fp32, 4 layers.
Measured spread against one process (3 steps): loss <= 4.5e-8, grad norm <= 7.2e-8, weights <= 1.2e-7
for every schedule; interleaved 1F1B with FSDP 2: 6.5e-8, 1.5e-7, 1.5e-7; REL is 1e-5 as the issue
asks. Without the document ids on the stages (a hand mutation of `pipeline_kwargs`) the loss is off
by 3.8e-3 and the grad norm by 0.84. (Without the positions alone nothing changes beyond rounding: under a document
mask, RoPE sees only distances within a document, which a shift of every position keeps.)
"""

import pytest
import torch
from _packed_rows_provider import PackedRows
from _quickstart import NO_CLIP, ROOT, SGD, compare_runs, overrides, train

REL = 1e-5
STEPS = 3
SEQ = 32
MICROBATCH = 2
#: 4 layers (each of 2 ranks × 2 chunks gets one), 4 microbatches of 2 rows per step.
SHAPE = ["model.num_layers=4", "data.global_batch_size=8", f"data.microbatch_size={MICROBATCH}"]
PACKED = [
    f"providers.dataset={ROOT / 'tests' / '_packed_rows_provider.py'}:PackedRowsProvider",
    f"dataset.path={ROOT / 'examples' / 'data' / 'corpus.txt'}",
]
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"]


def _args(tmp_path, name, *extra):
    return overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, *SHAPE, *PACKED, *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp-packed-reference")
    return train(1, _args(tmp, "one"))


def test_the_rows_cross_row_and_microbatch_boundaries():
    rows = PackedRows((ROOT / "examples" / "data" / "corpus.txt").read_bytes(), SEQ, 8 * STEPS)
    docs, positions = rows.columns["document_ids"], rows.columns["position_ids"]
    continues = positions[:, 0] > 0  # the row starts inside a document begun in the row before
    assert (
        continues[1::MICROBATCH].any() and continues[MICROBATCH::MICROBATCH].any()
    )  # in and across microbatches
    assert (positions[1:, 0] == 0).any()  # a document starting exactly at a row's start
    assert (docs == docs[:, :1]).all(1).any()  # a document spanning a whole row
    assert max(len(torch.unique(row)) for row in docs) >= 4  # and rows of many documents


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_packed_rows_on_every_schedule_equal_one_process(tmp_path, reference, schedule):
    got = train(2, _args(tmp_path, schedule, "mesh.pipeline_parallel=2", f"pipelining.schedule={schedule}"))
    compare_runs(got, reference, rel=REL)


def test_packed_rows_on_interleaved_pp2_with_fsdp2_equal_one_process(tmp_path, reference):
    extra = ["mesh.pipeline_parallel=2", "mesh.data_parallel_shard=2", "pipelining.schedule=interleaved_1f1b"]
    got = train(4, _args(tmp_path, "interleaved-fsdp2", *extra))
    compare_runs(got, reference, rel=REL)
