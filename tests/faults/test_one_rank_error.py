"""A 2-rank torchrun job whose dataset exists for rank 0 but not for rank 1: the error is not
swallowed. Rank 1 reports it once, naming the path and itself; rank 0 (which only sees a broken
collective) stays quiet, and the job exits non-zero."""

import shutil
from pathlib import Path

import pytest
from _quickstart import CONFIG, TRAIN, overrides

from d9d.mesh.testing import run_torchrun

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

_PROVIDER = '''
import os
from pathlib import Path

import msgspec

from d9d.data import TextDataset
from d9d.trainer.providers import BuildDatasetResult


class RankCorpusConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq_len: int = 32


class RankCorpus:
    """Reads corpus-rank<RANK>.txt next to this file: only rank 0's exists (a path one node lacks)."""

    config_type = RankCorpusConfig

    def __init__(self, config):
        self.config = config

    def build_dataset(self, context):
        path = Path(__file__).parent / f"corpus-rank{os.environ['RANK']}.txt"
        return BuildDatasetResult(dataset=TextDataset(path, self.config.seq_len))
'''


@pytest.mark.parametrize("entry", ["script", "cli"])
def test_a_dataset_missing_on_rank_1_is_reported_once_by_rank_1_torchrun_2(tmp_path, entry):
    (tmp_path / "rank_corpus.py").write_text(_PROVIDER, encoding="utf-8")
    shutil.copy(ROOT / "examples" / "data" / "corpus.txt", tmp_path / "corpus-rank0.txt")
    args = overrides(
        tmp_path / "runs",
        "one-rank",
        4,
        "mesh.data_parallel_shard=2",
        f"providers.dataset={tmp_path / 'rank_corpus.py'}:RankCorpus",
        "dataset={seq_len: 32}",
    )
    logs = tmp_path / "torchrun-logs"
    if entry == "script":  # python train.py config.yaml key=value ...
        command = [TRAIN, CONFIG, *args]
    else:  # d9d train config.yaml --set key=value ...
        command = ["-m", "d9d.cli", "train", CONFIG, *[a for item in args for a in ("--set", item)]]
    result = run_torchrun(
        ["--log-dir", str(logs), "--redirects", "3", *command], nproc_per_node=2, timeout=180
    )
    assert result.returncode != 0
    stderr = {int(p.parent.name): p.read_text(errors="replace") for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == [0, 1], sorted(logs.rglob("*"))
    errors = {
        rank: [line for line in text.splitlines() if line.startswith("error:")]
        for rank, text in stderr.items()
    }
    missing = str(tmp_path / "corpus-rank1.txt")
    assert errors[0] == [], stderr[0][-3000:]
    assert len(errors[1]) == 1, stderr[1][-3000:]
    assert errors[1][0].startswith("error: rank 1: ") and missing in errors[1][0], errors[1]
    assert not [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "Traceback" not in stderr[1]
    # torchrun's failure summary names rank 1's error as the root cause (its error file), not <N/A>.
    root_cause = result.stderr.split("Root Cause", 1)[-1]
    assert "rank      : 1" in root_cause and f"traceback : {errors[1][0]}" in root_cause, result.stderr[
        -3000:
    ]
