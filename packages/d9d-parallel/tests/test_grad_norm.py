import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import clip_grad_norm_, grad_norm

SHAPES = [(5, 6), (4,), (8, 3), (6, 4), (3, 3), (7,)]


def _full_grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _param(full: torch.Tensor, mesh, placements) -> nn.Parameter:
    """A parameter whose gradient is `full` laid out as `placements` (Partial: unreduced pieces)."""
    if mesh is None:
        param = nn.Parameter(torch.zeros_like(full))
        param.grad = full.clone()
        return param
    if placements == [Partial()]:  # 1-D: uneven pieces that sum to `full`
        pieces = torch.tensor([0.25, 0.75, 1.5, -1.5])[: mesh.size()]
        pieces[-1] += 1 - pieces.sum()
        grad = DTensor.from_local(full * pieces[mesh.get_local_rank()], mesh, placements, run_check=False)
    else:
        grad = distribute_tensor(full.clone(), mesh, placements)
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    return param


def _layouts(ctx: DistributedContext, stage: int):
    """Per pipeline stage, each full gradient with its (mesh, placements); None means a plain tensor."""
    dense, expert = ctx.mesh("dense"), ctx.mesh("expert")
    if stage == 0:
        return [
            (dense["tp"], [Shard(0)]),  # uneven: 5 rows over 2 ranks
            (dense["tp"], [Replicate()]),
            (expert["ep_shard"], [Shard(0)]),
        ]
    return [(dense["tp"], [Shard(1)]), (None, None), (expert["ep_shard"], [Shard(0)])]


def _norm_over_stages(norm_type: float, max_norm: float):
    config = MeshConfig(pipeline_parallel=2, tensor_parallel=2, expert_parallel=2)
    with DistributedContext.from_env(config) as ctx:
        stage = ctx.coordinate("pp")
        full = _full_grads()
        mine = full[3 * stage : 3 * stage + 3]
        params = [_param(f, m, p) for f, (m, p) in zip(mine, _layouts(ctx, stage), strict=True)]
        pp_mesh = ctx.mesh("dense")["pp"]
        norm = grad_norm(params, norm_type=norm_type, pp_group=pp_mesh)
        clipped = clip_grad_norm_(params, max_norm, norm_type=norm_type, pp_group=pp_mesh)
        after = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
        return float(norm), float(clipped), stage, after


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_norm_over_pipeline_stages_and_meshes_4_ranks(norm_type):
    max_norm = 0.5
    results = run_distributed(_norm_over_stages, 4, norm_type, max_norm)
    full = _full_grads()
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full]), norm_type)
    want_after = torch.nn.utils.clip_grad_norm_  # torch's clipping of the same full gradients
    reference = [nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(reference, full, strict=True):
        p.grad = g.clone()
    torch_norm = want_after(reference, max_norm, norm_type=norm_type)
    torch.testing.assert_close(torch_norm, want)
    assert float(want) > max_norm  # so clipping is exercised
    for norm, clipped, stage, after in results:
        assert norm == pytest.approx(float(want), rel=1e-5)
        assert clipped == pytest.approx(float(want), rel=1e-5)
        for got, ref in zip(after, reference[3 * stage : 3 * stage + 3], strict=True):
            torch.testing.assert_close(got, ref.grad, rtol=1e-5, atol=1e-6)


def _norm_on_2d_meshes():
    config = MeshConfig(data_parallel_shard=2, tensor_parallel=2, expert_parallel=4)
    with DistributedContext.from_env(config) as ctx:
        dense = ctx.mesh("dense")
        dp_tp = dense["dp_shard", "tp"]
        layouts = [
            (dp_tp, [Shard(0), Shard(1)]),
            (dp_tp, [Shard(0), Replicate()]),
            (dp_tp, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over TP's layout
            (ctx.mesh("expert")["ep_shard"], [Shard(0)]),
            (dense["tp"], [Partial()]),  # e.g. sequence-parallel norm weights
            (None, None),
        ]
        params = [_param(f, m, p) for f, (m, p) in zip(_full_grads(), layouts, strict=True)]
        return float(grad_norm(params))


def test_norm_on_2d_and_expert_meshes_without_pipeline_4_ranks():
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _full_grads()]))
    for norm in run_distributed(_norm_on_2d_meshes, 4):
        assert norm == pytest.approx(float(want), rel=1e-5)


def test_plain_tensors_in_one_process():
    params = [_param(g, None, None) for g in _full_grads()]
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _full_grads()]))
    assert float(grad_norm(params)) == pytest.approx(float(want), rel=1e-6)
    assert float(grad_norm([])) == 0.0
