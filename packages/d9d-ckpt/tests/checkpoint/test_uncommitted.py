"""A `save-<step>` directory without a commit record is reported, never loaded, replaced or deleted."""

import pytest
from torch import nn

from d9d.ckpt import CheckpointError, CheckpointManager


def test_uncommitted_step_dir_is_refused_and_kept(tmp_path):
    model = nn.Linear(3, 2)
    foreign = tmp_path / "run" / "save-2"
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_bytes(b"not ours")
    with CheckpointManager(tmp_path, "run") as manager:
        assert manager.latest() is None
        with pytest.raises(
            CheckpointError, match=r"save-2: no valid commit\.json.*neither loaded nor replaced"
        ):
            manager.check_uncommitted()
        manager.save(1, model)  # other steps save as usual
        with pytest.raises(CheckpointError, match=r"save-2: no valid commit\.json"):
            manager.save(2, model)
    assert (foreign / "weights.bin").read_bytes() == b"not ours"
    assert [p.name for p in sorted((tmp_path / "run").iterdir()) if not p.name.startswith(".")] == [
        "save-1",
        "save-2",
    ]
