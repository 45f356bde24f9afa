"""`SavedActivations`: the peak of the bytes autograd holds saved for backward over any interleaving of
forwards and backwards, weights and the step's compute copies of them left out."""

import torch
from torch import nn

from d9d.parallel import SavedActivations, saved_activation_bytes, weights_cast_once
from d9d.parallel.weight_casts import cast_linears_once


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


def test_one_forward_and_backward_peaks_at_what_the_forward_saves_and_ends_at_zero():
    model, x = _mlp(), torch.randn(4, 16)
    once = saved_activation_bytes(lambda: _loss(model, x), exclude=model.parameters())
    # the input (4×16), the first output (4×32, saved by GELU), GELU's output (4×32), the last
    # output (4×8, saved by square): float32
    assert once == 4 * (4 * 16 + 4 * 32 + 4 * 32 + 4 * 8)
    with SavedActivations(exclude=model.parameters()) as saved:
        _loss(model, x).backward()
        assert saved.live == 0
    assert saved.peak == once


def test_forwards_kept_alive_together_add_up_and_each_backward_frees_its_own():
    model = _mlp()
    xs = [torch.randn(4, 16), torch.randn(4, 16), torch.randn(2, 16)]
    each = [saved_activation_bytes(lambda x=x: _loss(model, x), exclude=model.parameters()) for x in xs]
    with SavedActivations(exclude=model.parameters()) as saved:
        losses = [_loss(model, x) for x in xs]  # a pipeline's warm-up: three graphs alive at once
        assert saved.live == saved.peak == sum(each)
        losses[0].backward()
        assert saved.live == sum(each[1:])
        losses[2].backward()
        assert saved.live == each[1]
        losses[1].backward()
        assert saved.live == 0
    assert saved.peak == sum(each)


def test_weights_views_of_them_and_the_steps_compute_copies_do_not_count():
    model, x = _mlp(), torch.randn(4, 16)
    # no `exclude`: the weights (and the transposes matmuls save) are parameters, never counted
    with SavedActivations() as bare:
        _loss(model, x).backward()
    with SavedActivations(exclude=model.parameters()) as excluded:
        _loss(model, x).backward()
    assert bare.peak == excluded.peak > 0
    # bf16 under autocast, the weights cast once for the step: the copies matmuls save are not
    # counted, whatever the microbatches; without the scope each forward's own copy is
    cast_linears_once(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with SavedActivations() as per_forward:
            _loss(model, x).backward()
        with weights_cast_once() as casts, SavedActivations() as once:
            for _ in range(3):
                _loss(model, x).backward()
    assert casts is not None and casts.bytes > 0
    # the copy a matmul saves: the last linear's (for its input's gradient; the first linear's input
    # needs none, so its weight is not saved), bf16
    assert per_forward.peak - once.peak == 32 * 8 * 2, (per_forward.peak, once.peak)
    assert once.peak > 0
