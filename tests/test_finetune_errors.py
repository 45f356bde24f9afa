"""The fine-tune example's bad model folders are one line and exit 2, through a real process, writing nothing."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"


def _run(tmp_path: Path, model: dict) -> subprocess.CompletedProcess[str]:
    config = {
        "providers": {"model": f"{FINETUNE}:HFModelProvider", "dataset": f"{FINETUNE}:CorpusProvider"},
        "model": model,
        "dataset": {"path": str(ROOT / "examples" / "data" / "corpus.txt"), "seq_len": 32},
        "data": {"global_batch_size": 2, "microbatch_size": 1},
        "trainer": {
            "run": {"name": "bad"},
            "schedule": {"total_steps": 1},
            "checkpointing": {"save_dir": "runs"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(FINETUNE), str(path)], capture_output=True, text=True,
                          timeout=120, env={**env, "OMP_NUM_THREADS": "1"})  # fmt: skip


def test_a_model_folder_without_config_json_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _run(tmp_path, {"hf_folder": "empty"})
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "no config.json" in errors[0], errors
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()
