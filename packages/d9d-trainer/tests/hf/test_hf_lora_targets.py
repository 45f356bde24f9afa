"""LoRA patterns written with Llama's names on Phi-3 (fused `qkv_proj` and `gate_up_proj`): the job
trains only `o_proj` and `down_proj`, and the "job built" line, its warning and `d9d plan`'s plan say
so, naming the fused modules and the pattern that adds them; the plan's trainable count is the
built model's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, save_tiny

from d9d.trainer import Trainer, load_job_config
from d9d.trainer.planning import plan_config

LLAMA = r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
FIX = r"add '.*\.(qkv_proj|gate_up_proj)' to peft.lora.target_modules"


def test_llama_patterns_on_phi3_are_reported_per_layer_and_warn_naming_the_fused_projections(
    tmp_path, capsys
):
    folder = save_tiny("phi3", tmp_path / "phi3")
    lora = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": [LLAMA]}}
    config = hf_job(folder, tmp_path / "runs", peft=lora)
    with Trainer.from_config(config) as trainer:
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        adapted = sorted(
            {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainer.model.state_dict() if ".lora_" in n}
        )
    lines = capsys.readouterr().out.splitlines()
    (built,) = [line for line in lines if "d9d.trainer: job built" in line]
    assert adapted == ["down_proj", "o_proj"]  # what the warning is about: q, k, v, gate, up train nowhere
    assert f"trainable_params={trainable} " in built
    assert f"lora_targets='{LLAMA}: 2 in each of 2 layers'" in built
    (warning,) = [line for line in lines if " WARNING " in line and "target_modules" in line]
    assert "qkv_proj (holding q/k/v; the patterns name q_proj/k_proj/v_proj)" in warning
    assert "gate_up_proj (holding gate/up; the patterns name gate_proj/up_proj)" in warning
    assert "(e.g. model.layers.0.self_attn.qkv_proj)" in warning and warning.endswith(FIX)

    memory = plan_config(load_job_config(config), device="cpu").memory  # `d9d plan` says the same
    assert memory is not None and memory.lora is not None
    assert memory.trainable_parameters == trainable
    assert (memory.lora.warning() or "") in warning
