"""The fine-tune example starts from a Hugging Face folder and exports a folder transformers loads."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune"

pytestmark = pytest.mark.slow


def test_finetune_from_hf_folder_and_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    script = str(EXAMPLE / "finetune.py")
    subprocess.run([sys.executable, script, "make-demo", str(tmp_path / "hf")], check=True, env=env, cwd=tmp_path,
                   capture_output=True)  # fmt: skip
    args = [
        f"model.hf_folder={tmp_path / 'hf'}",
        f"trainer.checkpointing.save_dir={tmp_path / 'runs'}",
        f"export.dir={tmp_path / 'export'}",
        "trainer.schedule.total_steps=2",
        "dataset.seq_len=32",
    ]
    run = subprocess.run([sys.executable, script, str(EXAMPLE / "config.yaml"), *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loaded starting weights" in run.stdout
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before, after = source(ids).logits, tuned(ids).logits
    assert after.shape == before.shape and not torch.allclose(after, before)  # trained, and loadable by HF
