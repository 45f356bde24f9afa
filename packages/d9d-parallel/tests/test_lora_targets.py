"""`lora_coverage`: what each LoRA pattern adapts per layer, and the projections a pattern set written
for another model family leaves without adapters (Phi-3's fused `qkv_proj` / `gate_up_proj` under
Llama's names), said in one warning line."""

import pytest
import torch
from torch import nn

from d9d.parallel import LoraConfig, apply_lora, lora_coverage

#: Llama's projection names, as the fine-tune example writes them.
LLAMA_TARGETS = [r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"]


class _Attention(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        if fused:
            self.qkv_proj = nn.Linear(8, 24)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.o_proj = nn.Linear(8, 8)


class _Mlp(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        if fused:
            self.gate_up_proj = nn.Linear(8, 32)
        else:
            self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)
        self.down_proj = nn.Linear(16, 8)
        self.gate = nn.Linear(8, 4)  # an MoE router's name: no projection


class _Layer(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(fused), _Mlp(fused)


class _Decoder(nn.Module):
    """Phi-3's module names (fused) or Llama's, two layers and a head, on the meta device."""

    def __init__(self, fused: bool, layers: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer(fused) for _ in range(layers))
        self.lm_head = nn.Linear(8, 32)


def _coverage(fused: bool, targets: list[str], layers: int = 2, **options: bool):
    with torch.device("meta"):
        model = _Decoder(fused, layers)
    config = LoraConfig(rank=2, alpha=4.0, target_modules=targets)
    apply_lora(model, config)
    return lora_coverage(model, config, **options)


def test_llama_names_on_fused_projections_name_the_fused_modules_and_the_fix_in_one_line():
    coverage = _coverage(True, LLAMA_TARGETS)
    assert coverage.layers == ("model.layers.0", "model.layers.1")
    assert [(p.per_layer, p.outside) for p in coverage.patterns] == [((2, 2), 0)]  # o_proj, down_proj
    assert coverage.describe() == f"{LLAMA_TARGETS[0]}: 2 in each of 2 layers"
    assert [(m.name, m.holds, m.named) for m in coverage.missed] == [
        ("qkv_proj", ("q", "k", "v"), ("q_proj", "k_proj", "v_proj")),
        ("gate_up_proj", ("gate", "up"), ("gate_proj", "up_proj")),
    ]
    assert coverage.missed[0].paths == (
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.qkv_proj",
    )
    warning = coverage.warning()
    assert warning is not None and "\n" not in warning
    assert warning.startswith("peft.lora.target_modules leave qkv_proj (holding q/k/v; the patterns name ")
    assert "gate_up_proj (holding gate/up; the patterns name gate_proj/up_proj)" in warning
    assert "in 2 layers (e.g. model.layers.0.self_attn.qkv_proj)" in warning
    assert warning.endswith(r"add '.*\.(qkv_proj|gate_up_proj)' to peft.lora.target_modules")
    assert "gate," not in warning and "mlp.gate " not in warning  # the router is no projection


def test_the_fix_it_gives_covers_every_projection_and_silences_it():
    fixed = _coverage(True, [*LLAMA_TARGETS, r".*\.(qkv_proj|gate_up_proj)"])
    assert fixed.missed == () and fixed.warning() is None
    assert fixed.describe().endswith(r"; .*\.(qkv_proj|gate_up_proj): 2 in each of 2 layers")


@pytest.mark.parametrize(
    "targets",
    [LLAMA_TARGETS, [r".*\.(q_proj|v_proj)"], [r".*\.o_proj"]],
    ids=["every-projection", "q-and-v-by-choice", "o-only"],
)
def test_projections_left_out_by_choice_under_their_own_names_give_no_warning(targets):
    coverage = _coverage(False, targets)
    assert coverage.missed == () and coverage.warning() is None


def test_q_and_v_on_a_fused_model_miss_the_fused_module_naming_only_what_the_patterns_name():
    coverage = _coverage(True, [r".*\.(q_proj|v_proj|o_proj)"])
    assert [(m.name, m.named) for m in coverage.missed] == [("qkv_proj", ("q_proj", "v_proj"))]


def test_a_pattern_that_matches_nothing_in_some_layers_or_at_all_is_named():
    targets = [r"model\.layers\.[0-1]\..*\.o_proj", r".*\.v_prj", r"lm_head"]
    coverage = _coverage(False, targets, layers=4)
    assert coverage.describe() == (
        r"model\.layers\.[0-1]\..*\.o_proj: 1 in model.layers.0..1, 0 in model.layers.2..3; "
        r".*\.v_prj: 0 in each of 4 layers; lm_head: 0 in each of 4 layers, 1 outside the layers"
    )
    assert coverage.warning() == (
        r"pattern 'model\.layers\.[0-1]\..*\.o_proj' of peft.lora.target_modules matches nothing in "
        r"model.layers.2, model.layers.3; "
        r"pattern '.*\.v_prj' of peft.lora.target_modules matches no nn.Linear"
    )
    # a pipeline stage holds some layers only: a pattern may match on another stage
    part = _coverage(False, targets, layers=4, whole_model=False).warning()
    assert part is not None and "v_prj" not in part and "model.layers.2" in part


def test_other_fused_names_count_as_the_projections_they_hold():
    with torch.device("meta"):
        model = nn.Module()
        model.layers = nn.ModuleList([nn.Module()])
        block = model.layers[0]
        block.query_key_value, block.dense, block.out_proj = (
            nn.Linear(4, 12),
            nn.Linear(4, 4),
            nn.Linear(4, 4),
        )
    config = LoraConfig(rank=2, alpha=4.0, target_modules=[r".*\.(q_proj|v_proj|out_proj)"])
    apply_lora(model, config)
    coverage = lora_coverage(model, config)
    assert [(m.name, m.holds, m.named) for m in coverage.missed] == [
        ("query_key_value", ("q", "k", "v"), ("q_proj", "v_proj"))
    ]
