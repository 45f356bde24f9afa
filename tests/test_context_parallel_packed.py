"""Context parallelism over packed rows through the trainer (the reference model): CP 2, CP 4,
CP 2 × FSDP 2 and CP 2 × TP 2 equal one process on the same packed data in every step's loss and
grad norm and in the final weights (fp32, SGD, 3 steps).

The rows (`PackedRowsProvider`) hold documents that cross chunk boundaries, start and end exactly at
them (at cp 2 and at cp 4), are one token long, span the whole row, and padding (-1), so a query that
saw a key of another document, or missed an earlier key of its own in another rank's chunk, would
change the loss. Measured (torch 2.15, CPU): loss <= 2.4e-8, grad norm <= 6.2e-8 and weights <= 9e-8
(relative) on every mesh below; a mask that ignores the other ranks' keys is off by 7e-4 in the
first loss and 1e-1 in the weights.
"""

from pathlib import Path

import msgspec
import pytest
import torch
from _quickstart import NO_CLIP, SGD, compare_runs, overrides, train

from d9d.data import IGNORE_INDEX
from d9d.trainer.providers import BuildDatasetContext, BuildDatasetResult

REL = 1e-5
STEPS = 3
SEQ = 32  # the tiny quickstart's dataset.seq_len: 4 chunks of 8 at cp 2, 8 chunks of 4 at cp 4
VOCAB = 257
PACKED = [f"providers.dataset={__file__}:PackedRowsProvider"]

#: Where documents start in the fixed layouts (besides 0), and where padding starts (None: none).
LAYOUTS: list[tuple[list[int], int | None]] = [
    ([3, 8, 19, 24], 29),  # ends and starts exactly at 8 and 24; 8..19 and 19..24 cross boundaries
    ([], None),  # one document over the whole row
    ([1, 17, 31], None),  # one token; 1..17 crosses every chunk up to 16; one token at the end
]


class _PackedRowsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str = ""  # the quickstart's dataset key; these rows are made here, not read
    seq_len: int = SEQ


def _documents(index: int, seq: int) -> torch.Tensor:
    """Document ids of sample `index`: a fixed layout, or (every fourth) a random one; -1 is padding."""
    if index % 4 < len(LAYOUTS):
        starts, padding = LAYOUTS[index % 4]
    else:
        gen = torch.Generator().manual_seed(index)
        starts, padding = sorted(torch.randperm(seq - 1, generator=gen)[:4].add(1).tolist()), None
    ids = (torch.arange(seq)[:, None] >= torch.tensor(starts, dtype=torch.long)[None, :]).sum(1)
    if padding is not None:
        ids[padding:] = -1
    return ids


class PackedRows(torch.utils.data.Dataset):
    """Packed rows as d9d.data yields them: per document a learnable +k sequence of tokens, positions
    restarting at 0 in every document (and in the padding), labels ignored across a boundary and on
    padding."""

    def __init__(self, seq: int, samples: int = 64) -> None:
        self.seq = seq
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        documents = _documents(index, self.seq + 1)
        gen = torch.Generator().manual_seed(1000 + index)
        first = torch.randint(0, VOCAB, (self.seq + 1,), generator=gen)
        step = 1 + documents.clamp_min(0) % 3
        starts = torch.cat([torch.tensor([True]), documents[1:] != documents[:-1]])
        positions = torch.zeros(self.seq + 1, dtype=torch.long)
        for i in range(1, self.seq + 1):
            positions[i] = 0 if starts[i] else positions[i - 1] + 1
        start_token = first[torch.cummax(torch.where(starts, torch.arange(self.seq + 1), 0), 0).values]
        tokens = (start_token + step * positions) % VOCAB
        labels = tokens[1:].clone()
        labels[documents[1:] != documents[:-1]] = IGNORE_INDEX  # no prediction across a boundary
        labels[documents[1:] < 0] = IGNORE_INDEX
        return {
            "input_ids": tokens[:-1],
            "labels": labels,
            "position_ids": positions[:-1],
            "document_ids": documents[:-1],
        }


class PackedRowsProvider:
    """`PackedRows` as a dataset provider (named by path in the job)."""

    config_type = _PackedRowsConfig

    def __init__(self, config: _PackedRowsConfig) -> None:
        self.config = config

    def build_dataset(self, context: BuildDatasetContext) -> BuildDatasetResult:
        return BuildDatasetResult(
            dataset=PackedRows(self.config.seq_len),
            seq_len=self.config.seq_len,
            vocab_size=VOCAB,
            document_masking=True,
        )


CP2 = ["mesh.context_parallel=2"]
MESHES = {
    "cp2": (2, CP2),
    "cp4": (4, ["mesh.context_parallel=4"]),
    "cp2-fsdp2": (4, [*CP2, "mesh.data_parallel_shard=2"]),
    "cp2-tp2": (4, [*CP2, "mesh.tensor_parallel=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("cp-packed-reference")
    return train(1, overrides(tmp, "one", STEPS, *SGD, *NO_CLIP, *PACKED))


@pytest.mark.parametrize("name", list(MESHES))
def test_packed_rows_on_context_parallel_equal_one_process(tmp_path: Path, reference, name: str) -> None:
    nproc, mesh = MESHES[name]
    got = train(nproc, overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, *PACKED, *mesh))
    assert reference.records[-1]["loss"] < reference.records[0]["loss"]
    compare_runs(got, reference, rel=REL)


def test_the_rows_hold_the_boundary_cases() -> None:
    """What the runs above rely on, checked on the rows themselves."""
    rows = PackedRows(SEQ)
    ids = torch.stack([rows[i]["document_ids"] for i in range(4)])
    for chunk in (SEQ // 4, SEQ // 8):  # cp 2, cp 4
        boundaries = range(chunk, SEQ, chunk)
        assert any(ids[0, b] != ids[0, b - 1] for b in boundaries)  # a document starts exactly at one
        assert any(ids[0, b] == ids[0, b - 1] for b in boundaries)  # one crosses one
    assert ids[1].unique().numel() == 1 and (ids[0] == -1).any()  # the whole row; padding
    sample = rows[0]
    starts = (sample["position_ids"] == 0).nonzero().squeeze(1).tolist()
    assert starts == [0, 3, 8, 19, 24, 29]  # positions restart in every document and the padding


def test_reordered_documents_on_context_parallel_equal_one_process(tmp_path: Path, reference) -> None:
    """`trainer.attention.balance_documents` moves whole documents within each row before the cp
    chunking: the same numbers as one process (and as the rows as packed), and a step's
    `cp_attention_balance` (the most loaded cp rank's attention pairs over the mean) no worse than
    with the rows as packed, and better on some step."""
    plain = train(2, overrides(tmp_path, "plain", STEPS, *SGD, *NO_CLIP, *PACKED, *CP2))
    balanced = ["trainer.attention.balance_documents=true"]
    got = train(2, overrides(tmp_path, "balanced", STEPS, *SGD, *NO_CLIP, *PACKED, *CP2, *balanced))
    compare_runs(got, reference, rel=REL)
    before = [r["cp_attention_balance"] for r in plain.records]
    after = [r["cp_attention_balance"] for r in got.records]
    assert all(1.0 <= a <= b for a, b in zip(after, before, strict=True)), (before, after)
    assert any(a < b for a, b in zip(after, before, strict=True)), (before, after)
    assert "cp_attention_balance" not in reference.records[0]  # one process: no cp ranks
