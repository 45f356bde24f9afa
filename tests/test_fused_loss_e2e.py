"""The quickstart with the fused head loss (`trainer.loss`, on by default) on one process, FSDP 2, DDP 2,
TP 2 (the head vocab-sharded: 129 and 128 of 257 rows) and PP 2 (the last stage's forward computes the
loss) equals one process with the full logits: losses and grad norms of every step and the weights
after 3 SGD steps. A dispatch mode over every op of training counts the rows of vocabulary-wide float
tensors each run makes: the fused runs never more than one chunk (24 of a microbatch's 64 tokens),
the full-logits run all 64."""

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _quickstart import CONFIG, NO_CLIP, SGD, RunResult, compare_runs, overrides, records, run_forked
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.mesh.testing import run_distributed
from d9d.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHUNK = 24  # does not divide a microbatch's 2 × 32 tokens
TOKENS = 64
#: The vocabulary (257) and its tp shards; no other dimension of this model is as wide
#: (intermediate 96: the quickstart's tiny 128 would be a shard's width).
WIDTHS = (257, 129, 128)
#: Measured (torch 2.15, CPU, 3 SGD steps): every run within 5.4e-8 of the full-logits process in
#: losses, 1.6e-7 in grad norms (TP 2), 9.8e-8 in weights.
REL = 1e-6
MESHES = {
    "one": (1, []),
    "fsdp2": (2, ["mesh.data_parallel_shard=2"]),
    "ddp2": (2, ["mesh.data_parallel_replicate=2"]),
    "tp2": (2, ["mesh.tensor_parallel=2"]),
    "pp2": (2, ["mesh.pipeline_parallel=2"]),
}


class _VocabRows(TorchDispatchMode):
    """The most rows of any new float tensor (not a view, not in place) as wide as the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage(a) for a in (*args, *(kwargs or {}).values())}
        for t in out if isinstance(out, tuple | list) else (out,):
            if _vocab_wide(t) and _storage(t) not in given:
                self.rows = max(self.rows, t.numel() // t.shape[-1])
        return out


def _vocab_wide(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] in WIDTHS


def _storage(t: object) -> int | None:
    """Where a plain tensor's (or parameter's) memory starts; None for anything else."""
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return t.untyped_storage().data_ptr()


def _train_watching(args: list[str]) -> dict[str, Any]:
    """Train (a forked process or rank): the widest vocabulary tensor's rows, and the full weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with Trainer.from_config(CONFIG, args) as trainer:
        with _VocabRows() as watch:
            trainer.train()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        weights = {name: t.detach().cpu().clone() for name, t in state.items()}
    return {"rows": watch.rows, "weights": weights}


def _run(tmp: Path, name: str, nproc: int, *extra: str) -> tuple[RunResult, list[int]]:
    args = overrides(tmp, name, 3, *SGD, *NO_CLIP, "model.intermediate_size=96", *extra)
    if nproc == 1:
        ranks = [run_forked(_train_watching, args, timeout=180)]
    else:
        ranks = run_distributed(_train_watching, nproc, args, timeout=180)
    weights: dict[str, torch.Tensor] = {}
    for rank in ranks:
        weights.update(rank["weights"])  # pipeline stages hold different names
    return RunResult(records(tmp / name), weights), [rank["rows"] for rank in ranks]


@pytest.fixture(scope="module")
def full_logits() -> tuple[RunResult, list[int]]:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(Path(tmp), "full", 1, "trainer.loss.fused=false")


def test_the_full_logits_run_makes_every_tokens_logits(full_logits):
    assert full_logits[1] == [TOKENS]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_fused_loss_equals_one_process_with_full_logits_and_never_makes_them(tmp_path, full_logits, mesh):
    nproc, degrees = MESHES[mesh]
    fused, rows = _run(tmp_path, mesh, nproc, f"trainer.loss.chunk_size={CHUNK}", *degrees)
    compare_runs(fused, full_logits[0], rel=REL)
    if mesh == "pp2":  # the first stage holds no head
        assert rows == [0, CHUNK]
    else:
        assert rows == [CHUNK] * nproc
