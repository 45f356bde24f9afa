"""The quickstart's export is a Hugging Face folder: transformers loads it and computes the same logits."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import MOE, overrides, run_local


@pytest.mark.parametrize("model", [[], MOE], ids=["dense", "moe"])
def test_quickstart_export_loads_in_transformers_with_the_same_logits(tmp_path, model):
    transformers = pytest.importorskip("transformers")
    from d9d.trainer.models import ReferenceForCausalLM, load_hf_pretrained, read_hf_config

    export = tmp_path / "export"
    result = run_local(
        overrides(tmp_path, "run", 2, f"export.dir={export}", "trainer.checkpointing.period_steps=0", *model)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (export / "config.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    ours = ReferenceForCausalLM(read_hf_config(export))
    load_hf_pretrained(ours, export)
    ours.eval()
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits.float(), ours(ids).float(), rtol=1e-4, atol=1e-4)
