"""Packed rows under context parallelism in the step (`d9d.trainer.step.documents`): the step's
attention balance (Σ over microbatches of the most loaded rank's pairs over Σ of the mean) and the
reordering of a batch's documents, which moves every per-token tensor with the same index."""

import torch

from d9d.trainer.step.documents import attention_balance, reorder_documents


def _batch(ids: list[int]) -> dict[str, torch.Tensor]:
    document_ids = torch.tensor([ids])
    starts = torch.cat([torch.tensor([True]), document_ids[0, 1:] != document_ids[0, :-1]])
    positions = torch.zeros(len(ids), dtype=torch.long)
    for i in range(1, len(ids)):
        positions[i] = 0 if starts[i] else positions[i - 1] + 1
    return {
        "input_ids": torch.arange(len(ids))[None] + 100,
        "labels": torch.arange(len(ids))[None] + 200,
        "position_ids": positions[None],
        "document_ids": document_ids,
        "hidden": torch.arange(2 * len(ids)).view(1, len(ids), 2),  # a per-token tensor with a feature dim
        "note": "kept",
    }


def test_the_step_balance_sums_each_microbatch_slowest_rank() -> None:
    # cp 2, chunks of 2: a whole-row document is even; [0,0,0,0,0,0,1,2] loads rank 0 (chunks 0 and 3)
    even = _batch([0] * 8)
    late = _batch([0, 0, 0, 0, 0, 0, 1, 2])
    rank0_late, rank1_late = 1 + 2 + 1 + 1, 3 + 4 + 5 + 6  # pairs of chunks 0 + 3 and 1 + 2
    slowest = 18 + max(rank0_late, rank1_late)  # the even row: 36 pairs, 18 per rank
    mean = 18 + (rank0_late + rank1_late) / 2
    assert attention_balance([even, late], 2) == slowest / mean
    assert attention_balance([even], 2) == 1.0
    assert attention_balance([even, late], 1) is None
    assert attention_balance([{"input_ids": torch.zeros(1, 8)}], 2) is None


def test_reordering_moves_every_per_token_tensor_alike() -> None:
    batch = _batch([0] * 2 + [1] * 2 + [2] * 4 + [3] * 8)  # the long document last: cp 2 loads rank 0
    moved = reorder_documents(batch, 2)
    index = moved["input_ids"][0] - 100
    assert sorted(index.tolist()) == list(range(16)) and not torch.equal(index, torch.arange(16))
    for key in ("labels", "position_ids", "document_ids"):
        assert torch.equal(moved[key][0], batch[key][0][index]), key
    assert torch.equal(moved["hidden"][0], batch["hidden"][0][index])
    assert moved["note"] == "kept"
    assert attention_balance([moved], 2) < attention_balance([batch], 2)


def test_a_batch_without_positions_or_cp_stays_as_it_is() -> None:
    batch = _batch([0] * 4 + [1] * 4 + [2] * 8)
    assert reorder_documents(batch, 1) is batch
    no_positions = {k: v for k, v in batch.items() if k != "position_ids"}
    assert reorder_documents(no_positions, 4) is no_positions
    assert reorder_documents([batch["input_ids"]], 4) == [batch["input_ids"]]
