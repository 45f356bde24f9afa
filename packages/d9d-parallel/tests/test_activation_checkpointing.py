"""Activation checkpointing: which blocks, in place and idempotent, the same gradients bit for bit, and
the saved-activation count that shows what it saves."""

import copy

import msgspec
import pytest
import torch
import torch.nn.functional as F
from _tiny_transformer import TinyConfig, TinyTransformer, make_batches, make_model
from torch import nn

from d9d.parallel import (
    ActivationCheckpointingConfig,
    ParallelizeError,
    apply_activation_checkpointing,
    checkpointed_blocks,
    saved_activation_bytes,
)

CFG = TinyConfig(n_layers=4)


def _config(mode: str, every: int = 2) -> ActivationCheckpointingConfig:
    return ActivationCheckpointingConfig(mode=mode, every=every)


# --- which blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "mode", "every", "want"),
    [
        (4, "none", 2, []),
        (0, "full", 2, []),
        (1, "full", 2, [0]),
        (4, "full", 3, [0, 1, 2, 3]),  # `every` only matters for selective
        (1, "selective", 2, [0]),
        (4, "selective", 2, [0, 2]),
        (5, "selective", 2, [0, 2, 4]),
        (7, "selective", 3, [0, 3, 6]),
        (3, "selective", 1, [0, 1, 2]),  # every block, like full
        (3, "selective", 5, [0]),
        (4, "op", 3, [0, 1, 2, 3]),  # every block, per op
    ],
)
def test_checkpointed_blocks(n, mode, every, want):
    assert checkpointed_blocks(n, _config(mode, every)) == want


@pytest.mark.parametrize("n", [0, 1, 2, 5, 8, 13])
@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_checkpointed_blocks_selective_every_kth(n, every):
    got = checkpointed_blocks(n, _config("selective", every))
    assert got == [i for i in range(n) if i % every == 0]
    assert checkpointed_blocks(n, _config("full")) == list(range(n))
    assert checkpointed_blocks(n, _config("op", every)) == list(range(n))
    assert checkpointed_blocks(n, _config("none", every)) == []


def test_default_config_checkpoints_nothing():
    assert ActivationCheckpointingConfig().mode == "none"
    assert checkpointed_blocks(6, ActivationCheckpointingConfig()) == []


@pytest.mark.parametrize("every", [0, -1])
def test_bad_every_is_rejected(every):
    with pytest.raises(
        ValueError, match=rf"trainer\.activation_checkpointing\.every must be >= 1, got {every}"
    ):
        ActivationCheckpointingConfig(mode="selective", every=every)
    with pytest.raises(msgspec.ValidationError, match="every must be >= 1"):
        msgspec.convert({"mode": "selective", "every": every}, ActivationCheckpointingConfig)


def test_bad_mode_is_rejected():
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'sometimes'"):
        msgspec.convert({"mode": "sometimes"}, ActivationCheckpointingConfig)


def test_apply_refuses_what_is_not_a_config():
    with pytest.raises(ParallelizeError, match="must be an ActivationCheckpointingConfig"):
        apply_activation_checkpointing([nn.Linear(2, 2)], {"mode": "full"})  # type: ignore[arg-type]


# --- applied in place ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "want"), [("none", []), ("full", [0, 1, 2, 3]), ("selective", [0, 2])])
def test_apply_is_in_place_idempotent_and_keeps_keys(mode, want):
    model = make_model(cfg=CFG)
    keys = list(model.state_dict())
    done = apply_activation_checkpointing(model.blocks, _config(mode))
    assert [b for b in done] == [model.blocks[i] for i in want]
    wrapped = {i: b.forward for i, b in enumerate(model.blocks) if "forward" in vars(b)}
    assert sorted(wrapped) == want  # only the chosen blocks were touched
    again = apply_activation_checkpointing(model.blocks, _config(mode))
    assert again == done
    assert {i: b.forward for i, b in enumerate(model.blocks) if "forward" in vars(b)} == wrapped
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in make_model(cfg=CFG).named_parameters()]


def test_apply_without_config_checkpoints_every_module():
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert apply_activation_checkpointing(blocks) == blocks
    assert all("forward" in vars(b) for b in blocks)


def test_full_after_selective_adds_the_rest_once():
    model = make_model(cfg=CFG)
    apply_activation_checkpointing(model.blocks, _config("selective"))
    first = model.blocks[0].forward
    assert len(apply_activation_checkpointing(model.blocks, _config("full"))) == 4
    assert model.blocks[0].forward is first  # not wrapped twice


# --- same numbers -------------------------------------------------------------------------------


def _loss_and_grads(mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = make_model(cfg=CFG)
    apply_activation_checkpointing(model.blocks, _config(mode))
    tokens = make_batches(1, 2, 8)[0]
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_gradients_identical_with_and_without_checkpointing(mode):
    want_loss, want = _loss_and_grads("none")
    got_loss, got = _loss_and_grads(mode)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert grad is not None and torch.count_nonzero(grad) > 0, name
        assert torch.equal(got[name], grad), name


def test_checkpointing_recomputes_the_forward_in_backward():
    """The proof it is on: each checkpointed block's forward runs again during backward."""
    model = make_model(cfg=CFG)
    calls = []
    for i, block in enumerate(model.blocks):
        # (module forward hooks do not fire in the recomputation: count the forward itself)
        def counted(x: torch.Tensor, forward=block.mlp.forward, i=i) -> torch.Tensor:
            calls.append(i)
            return forward(x)

        block.mlp.forward = counted
    apply_activation_checkpointing(model.blocks, _config("selective"))
    tokens = make_batches(1, 2, 8)[0]
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    assert calls == [0, 1, 2, 3]
    calls.clear()
    loss.backward()
    assert sorted(calls) == [0, 2]


# --- saved_activation_bytes ---------------------------------------------------------------------


def _saved(model: nn.Module, device: str = "cpu") -> int:
    tokens = make_batches(1, 2, 8)[0].to(device)

    def forward() -> torch.Tensor:
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    return saved_activation_bytes(forward, exclude=model.parameters())


def test_saved_bytes_drop_with_full_checkpointing():
    measured = {}
    for mode in ("none", "selective", "full"):
        model = make_model(cfg=CFG)
        apply_activation_checkpointing(model.blocks, _config(mode))
        measured[mode] = _saved(model)
    assert measured["full"] < measured["selective"] < measured["none"], measured
    assert measured["full"] <= 0.5 * measured["none"], measured


def test_a_tensor_saved_twice_counts_once():
    x = torch.randn(3, 5, requires_grad=True)
    assert saved_activation_bytes(lambda: x * x) == x.nbytes  # mul saves self and other: one storage
    assert saved_activation_bytes(lambda: x * x.view(5, 3).view(3, 5)) == x.nbytes  # a view: same storage
    y = torch.randn(3, 5, requires_grad=True)
    assert saved_activation_bytes(lambda: x * y) == x.nbytes + y.nbytes


def test_parameters_and_their_views_are_excluded():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    # mm saves the input and the weight's transpose (a view of the parameter)
    assert saved_activation_bytes(lambda: layer(x)) == x.nbytes + layer.weight.nbytes
    assert saved_activation_bytes(lambda: layer(x), exclude=layer.parameters()) == x.nbytes


def test_nothing_saved_without_grad():
    model = make_model(cfg=CFG)
    with torch.no_grad():
        assert _saved(model) == 0


def test_saved_bytes_work_on_the_meta_device():
    measured = {}
    for mode in ("none", "full"):
        with torch.device("meta"):
            model = TinyTransformer(CFG)
        apply_activation_checkpointing(model.blocks, _config(mode))
        measured[mode] = _saved(model, "meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert 0 < measured["full"] <= 0.5 * measured["none"], measured
    # the meta count is the real one up to attention's kernel (another one runs on meta)
    assert measured["none"] == pytest.approx(_saved(make_model(cfg=CFG)), rel=0.05)
    x = torch.empty(3, 5, device="meta", requires_grad=True)
    assert saved_activation_bytes(lambda: x * x) == 3 * 5 * 4  # the same tensor twice counts once


def test_meta_count_excludes_parameter_views_like_the_real_count():
    for device in ("cpu", "meta"):
        layer = nn.Linear(16, 8, bias=False, device=device)
        x = torch.randn(4, 16, device=device, requires_grad=True)
        saved = saved_activation_bytes(lambda layer=layer, x=x: layer(x), exclude=layer.parameters())
        assert saved == 4 * 16 * 4, device


def test_meta_count_matches_the_real_count_on_the_tiny_transformer():
    real = _saved(make_model(cfg=CFG))
    with torch.device("meta"):
        model = TinyTransformer(CFG)
    assert _saved(model, "meta") == pytest.approx(real, rel=0.05)


def test_saved_bytes_counted_per_model_copy():
    """Counting does not keep tensors alive past the call or change what backward computes."""
    model = make_model(cfg=CFG)
    twin = copy.deepcopy(model)
    tokens = make_batches(1, 2, 8)[0]
    holder = {}

    def forward() -> None:
        holder["loss"] = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    assert saved_activation_bytes(forward, exclude=model.parameters()) > 0
    holder["loss"].backward()
    F.cross_entropy(twin(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_a_deepcopy_of_a_checkpointed_block_uses_its_own_weights():
    model = make_model(cfg=CFG)
    apply_activation_checkpointing(model.blocks, _config("full"))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(2.0)
    tokens = make_batches(1, 2, 8)[0][:, :-1]
    F.cross_entropy(twin(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is None for p in model.parameters())  # the original was not involved
    assert all(p.grad is not None for p in twin.parameters())
