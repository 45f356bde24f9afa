"""`materialize_and_initialize(loaded=...)`: what a load fills next is allocated and zeroed, not
initialized; everything else gets exactly the values it gets without a load (same per-module seeds)."""

import pytest
import torch
from torch import nn

from d9d.parallel import LoraConfig, apply_lora, lora_parameter_names
from d9d.trainer import materialize_and_initialize
from d9d.trainer.build.materialize import ModelInitError


class _Mixed(nn.Module):
    """A loaded weight beside a random non-persistent table that no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 8))
        self.register_buffer("table", torch.empty(6), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)  # drawn first: the table's values depend on this draw
        nn.init.uniform_(self.table)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.mixed = _Mixed()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied


def _built(loaded: bool) -> tuple[nn.Module, frozenset[str]]:
    with torch.device("meta"):
        model = _Model()
    apply_lora(model, LoraConfig(rank=2, target_modules=["proj"]))
    keys = frozenset(model.state_dict()) - set(lora_parameter_names(model))
    materialize_and_initialize(model, torch.device("cpu"), seed=3, loaded=keys if loaded else ())
    return model, keys


def test_loaded_tensors_are_zeroed_and_the_rest_initialized_as_without_a_load():
    plain, _ = _built(loaded=False)
    model, keys = _built(loaded=True)
    assert model.head.weight is model.embed.weight  # the tie survives
    state, expected = model.state_dict(), plain.state_dict()
    for key in keys:
        assert torch.count_nonzero(state[key]) == 0, key
        assert torch.count_nonzero(expected[key]) > 0, key  # (initialized without a load)
    adapters = lora_parameter_names(model)
    assert adapters
    for key in adapters:  # LoRA A is random: the same draw as without a load
        torch.testing.assert_close(state[key], expected[key], rtol=0, atol=0)
    assert torch.count_nonzero(model.mixed.table) > 0
    torch.testing.assert_close(model.mixed.table, plain.mixed.table, rtol=0, atol=0)


def test_a_loaded_key_the_model_lacks_is_refused():
    with torch.device("meta"):
        model = _Model()
    with pytest.raises(ModelInitError, match=r"loaded names \['embed.bias'\].*state-dict keys"):
        materialize_and_initialize(model, torch.device("cpu"), seed=0, loaded={"embed.bias"})
