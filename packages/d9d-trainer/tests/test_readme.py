"""The README's example job runs as written (a few steps), as a plain process."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_job_trains_and_checkpoints(tmp_path):
    train, config = re.findall(r"```(?:python|yaml)\n(.*?)```", README.read_text(), re.S)[:2]
    (tmp_path / "train.py").write_text(train)
    (tmp_path / "config.yaml").write_text(config)
    result = subprocess.run(
        [sys.executable, "train.py", "config.yaml", "trainer.schedule.total_steps=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step=3" in result.stdout
    assert (tmp_path / "runs" / "demo" / "save-3" / "commit.json").exists()
