"""In-place `torch.compile` per block: same keys, idempotent, off when disabled, eager's numbers.

torch.compile never runs in the pytest process (an inductor worker pool in the parent breaks the
tests that fork ranks later): every check runs in one forked process, which returns what it saw.
"""

import copy
from typing import Any

import pytest

from d9d.mesh.testing import run_distributed
from d9d.parallel import CompileConfig


def _check_compile() -> dict[str, Any]:
    """Every check, in the forked process that compiles; what it saw."""
    import torch._inductor.config
    import torch.nn.functional as F
    from _tiny_transformer import TinyConfig, make_batches, make_model

    from d9d.parallel import compile_blocks

    torch._inductor.config.compile_threads = 1  # no worker pool in the forked process either
    torch._dynamo.reset()  # counts start at 0 whatever the parent process did
    torch._dynamo.utils.counters.clear()
    seen: dict[str, Any] = {}
    cfg = TinyConfig(n_layers=2)
    model = make_model(cfg=cfg)
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]

    seen["disabled_returns"] = len(compile_blocks(model.blocks, CompileConfig(enabled=False)))
    seen["disabled_untouched"] = all(
        b._compiled_call_impl is None and not getattr(b, "_d9d_compiled", False) for b in model.blocks
    )
    seen["default_is_off"] = CompileConfig().enabled is False

    done = compile_blocks(model.blocks, CompileConfig(enabled=True))
    seen["returns_the_blocks"] = [id(b) for b in done] == [id(b) for b in model.blocks]
    seen["in_place"] = all(b._compiled_call_impl is not None for b in model.blocks)
    seen["root_not_compiled"] = model._compiled_call_impl is None
    impls = [b._compiled_call_impl for b in model.blocks]
    again = compile_blocks(model.blocks, CompileConfig(enabled=True))
    seen["idempotent"] = [id(b) for b in again] == [id(b) for b in model.blocks] and all(
        b._compiled_call_impl is impl for b, impl in zip(model.blocks, impls, strict=True)
    )
    seen["keys_unchanged"] = list(model.state_dict()) == keys
    seen["names_unchanged"] = [n for n, _ in model.named_parameters()] == names
    seen["orig_mod_keys"] = [k for k in model.state_dict() if "_orig_mod" in k]
    seen["loads_eager_state_strict"] = str(model.load_state_dict(eager.state_dict(), strict=True))

    tokens = make_batches(1, 2, 8)[0]
    outs, grads = [], []
    for m in (eager, model):
        logits = m(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        outs.append(logits.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    seen["max_output_diff"] = float((outs[0] - outs[1]).abs().max())
    seen["max_grad_diff"] = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in names)
    seen["compiled_frames"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    # Other sequence lengths (an eval set's, a last short batch): graphs after each training step
    graphs, diffs = [], []
    for seq in (12, 16, 24, 8):
        tokens = make_batches(1, 2, seq)[0]
        out = [m(tokens[:, :-1]) for m in (eager, model)]
        for logits in out:
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        diffs.append(float((out[0] - out[1]).abs().max()))
        graphs.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    seen["graphs_per_length"] = graphs
    seen["max_output_diff_other_lengths"] = max(diffs)

    none_config = torch.nn.Linear(4, 4)
    seen["none_config_compiles"] = (
        len(compile_blocks([none_config])) == 1 and none_config._compiled_call_impl is not None
    )
    return seen


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    # one forked process (world size 1): it reuses this process's imported torch and dynamo
    (found,) = run_distributed(_check_compile, 1, timeout=300)
    return found


def test_disabled_config_does_nothing(seen):
    assert seen["default_is_off"]
    assert seen["disabled_returns"] == 0
    assert seen["disabled_untouched"]


def test_compile_is_in_place_and_keeps_keys(seen):
    assert seen["returns_the_blocks"] and seen["in_place"]
    assert seen["root_not_compiled"]
    assert seen["keys_unchanged"] and seen["names_unchanged"]
    assert seen["orig_mod_keys"] == []
    assert seen["loads_eager_state_strict"] == "<All keys matched successfully>"


def test_compile_is_idempotent(seen):
    assert seen["idempotent"]


def test_compiled_blocks_match_eager(seen):
    assert seen["compiled_frames"] >= 1  # it really compiled
    assert seen["max_output_diff"] <= 1e-5
    assert seen["max_grad_diff"] <= 1e-5


def test_new_sequence_lengths_compile_one_more_graph_not_one_each(seen):
    """Measured on the 2 tiny blocks (one graph serves both), 11 training steps at 10 lengths:
    dynamic=False (the old default) 8 graphs, and past torch's recompile limit (8) the blocks ran
    eagerly; dynamic=None 2 (the first length static, as before; the second recompiles with the
    length dynamic, which every later length reuses); dynamic=True 1, but the one-length case
    compiles dynamic too. Below: lengths 7 (above), 11, 15, 23, 7 with the default."""
    assert CompileConfig().dynamic is None
    assert seen["compiled_frames"] == 1
    assert seen["graphs_per_length"] == [2, 2, 2, 2]
    assert seen["max_output_diff_other_lengths"] <= 1e-5


def test_no_config_means_compile(seen):
    assert seen["none_config_compiles"]
