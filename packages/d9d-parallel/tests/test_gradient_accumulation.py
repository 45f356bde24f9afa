"""Gradient accumulation over 4 microbatches on forked gloo ranks: the one-process gradients, and what
each rank holds in gradient memory between microbatches.

`set_gradient_accumulation` (reduce-scatter every microbatch on sharded units, defer only what costs no
memory) against `set_gradient_sync(False)` before the final microbatch (FSDP2 then keeps *unsharded*
gradients, on `FSDPParam._unsharded_param.grad`, until the last backward).
"""

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _grad_memory import Backward as _Backward
from _grad_memory import GradMemory as _GradMemory
from _tiny_transformer import TinyConfig, make_batches, make_model
from torch.distributed.fsdp import FSDPModule

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import parallelize_hsdp, set_gradient_accumulation, set_gradient_sync

MICROBATCHES = 4
BATCH = 16  # global rows: 8 per rank on 2 dp ranks, 4 on 4; 2 or 1 per microbatch
SEQ = 8
MODES = ("accumulation", "sync_off")
CFG = TinyConfig(n_layers=4)  # enough blocks that one block's gradient is small next to the model's


def _loss(model: torch.nn.Module, rows: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """The d9d contract: the microbatch's summed token loss over the GLOBAL batch's token count."""
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum") / global_tokens


def _accumulate(mesh: dict[str, int]) -> dict[str, Any]:
    """In each rank: 4 microbatches with each way of accumulating; gradients, bytes, collectives."""
    with DistributedContext.from_env(MeshConfig(**mesh)) as ctx:
        tokens = make_batches(1, BATCH, SEQ)[0]
        dp, dp_rank = ctx.axis_size("dp"), ctx.coordinate("dp")
        per_rank = BATCH // dp
        rows = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        result: dict[str, Any] = {"rank": ctx.rank}
        for mode in MODES:
            model = make_model(cfg=CFG)
            parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))
            kinds = sorted(
                {getattr(m, "_d9d_data_parallel", "?") for m in model.modules() if isinstance(m, FSDPModule)}
            )
            memory = _GradMemory(model)
            bytes_after, collectives, peaks = [], [], []
            for i, micro in enumerate(rows.chunk(MICROBATCHES)):
                final = i == MICROBATCHES - 1
                if mode == "accumulation":
                    set_gradient_accumulation(model, final=final)
                else:
                    set_gradient_sync(model, final)
                loss = _loss(model, micro, tokens[:, 1:].numel())
                if mode == "accumulation":  # (the recorder costs time: only where it is asserted on)
                    recorder = _Backward(memory)
                    with recorder:
                        loss.backward()
                    collectives.append(recorder.counts)
                    peaks.append(recorder.peak)
                else:
                    loss.backward()
                bytes_after.append(memory())
            result[mode] = {
                "kinds": kinds,
                "bytes": bytes_after,
                "collectives": collectives,
                "peaks_in_backward": peaks,
                "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                "local_grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            }
        return result


def _reference_grads() -> dict[str, torch.Tensor]:
    model = make_model(cfg=CFG)
    tokens = make_batches(1, BATCH, SEQ)[0]
    _loss(model, tokens, tokens[:, 1:].numel()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


_MODEL = make_model(cfg=CFG)
MODEL_GRAD_BYTES = sum(p.numel() * p.element_size() for p in _MODEL.parameters())
BLOCK_GRAD_BYTES = sum(p.numel() * p.element_size() for p in _MODEL.blocks[0].parameters())
#: The root unit (embedding, final norm, head): its head's gradient is computed first and reduced last.
ROOT_GRAD_BYTES = MODEL_GRAD_BYTES - CFG.n_layers * BLOCK_GRAD_BYTES
UNITS = CFG.n_layers + 1

MESHES = {
    "fsdp2": ({"data_parallel_shard": 2}, 2, "shard"),
    "hsdp2x2": ({"data_parallel_replicate": 2, "data_parallel_shard": 2}, 2, "hybrid"),
    "ddp2": ({"data_parallel_replicate": 2}, 1, "replicate"),
}


@pytest.fixture(scope="module", params=list(MESHES))
def launch(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    mesh, _, _ = MESHES[request.param]
    world = 1
    for size in mesh.values():
        world *= size
    return request.param, run_distributed(_accumulate, world, mesh)


def test_accumulated_gradients_match_one_process(launch):
    """Both ways of accumulating give the gradient of the global-batch mean loss (sum contract)."""
    name, results = launch
    want = _reference_grads()
    for result in results:
        for mode in MODES:
            assert result[mode]["kinds"] == [MESHES[name][2]]
            got = result[mode]["grads"]
            assert got.keys() == want.keys()
            for key, grad in want.items():
                torch.testing.assert_close(
                    got[key],
                    grad,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, k=key, md=mode: f"{name} {md} {k}: {m}",
                )


def test_accumulation_and_sync_off_give_the_same_local_shards(launch):
    _, results = launch
    for result in results:
        new, old = result["accumulation"]["local_grads"], result["sync_off"]["local_grads"]
        for key in new:
            torch.testing.assert_close(new[key], old[key], rtol=1e-5, atol=1e-7)


def _totals(per_microbatch: list[dict[str, int]]) -> list[int]:
    return [sum(b.values()) for b in per_microbatch]


def test_gradient_bytes_per_rank_between_microbatches(launch):
    """Sharded units hold 1/shard of the model's gradients all along; sync off holds the full model."""
    name, results = launch
    _, shard, kind = MESHES[name]
    limit = MODEL_GRAD_BYTES / shard + 1024  # slack: FSDP's padding of uneven shards
    for result in results:
        new = result["accumulation"]["bytes"]
        old = result["sync_off"]["bytes"]
        assert max(_totals(new)) <= limit, (name, new)
        if kind == "replicate":  # a replica's gradient is the full model whichever way
            assert _totals(new) == _totals(old) == [MODEL_GRAD_BYTES] * MICROBATCHES, (new, old)
            continue
        # the old way: the full unsharded model gradient until the final backward reduces it
        for before_final in old[:-1]:
            assert before_final["unsharded"] == MODEL_GRAD_BYTES, (name, old)
        assert max(_totals(old)) >= MODEL_GRAD_BYTES
        assert all(b["unsharded"] == 0 for b in new), (name, new)
        assert _totals(new)[-1] == _totals(old)[-1]  # after the final backward both hold the shards
        if kind == "hybrid":  # the reduce-scattered sum waits in one pending buffer, not in .grad
            assert all(b["pending"] > 0 and b["sharded"] == 0 for b in new[:-1]), new
            assert new[-1]["pending"] == 0


def test_gradient_bytes_peak_inside_backward(launch):
    """During backward a sharded unit's full gradient lives only until its reduce-scatter.

    (FSDP2's root unit holds the head, whose gradient comes first, and the embedding, whose comes last:
    the root's full gradient lives through the whole backward.)
    """
    name, results = launch
    _, shard, kind = MESHES[name]
    for result in results:
        new = result["accumulation"]["peaks_in_backward"]
        old = _totals(result["sync_off"]["bytes"])  # after backward: a lower bound of its peak
        if kind == "replicate":
            assert max(new) == max(old) == MODEL_GRAD_BYTES, (new, old)
            continue
        # the shards (or HSDP's pending sum), one block's and the root's full gradients, never more
        assert max(new) <= MODEL_GRAD_BYTES / shard + ROOT_GRAD_BYTES + BLOCK_GRAD_BYTES + 1024, (name, new)
        assert max(new) < 0.8 * MODEL_GRAD_BYTES, (name, new)
        assert min(old[:-1]) >= MODEL_GRAD_BYTES, (
            name,
            old,
        )  # sync off: the full model from the 1st backward


def test_collectives_skipped_only_where_memory_allows(launch):
    """FSDP reduce-scatters every microbatch; HSDP defers its all-reduce; DDP skips its all-reduce."""
    name, results = launch
    units = UNITS  # the blocks and the root
    for result in results:
        seen = result["accumulation"]["collectives"]
        final = seen[-1]
        before = seen[:-1]
        if name == "fsdp2":
            assert all(c == {"reduce_scatter": units, "all_reduce": 0} for c in seen), seen
        elif name == "hsdp2x2":
            assert all(c == {"reduce_scatter": units, "all_reduce": 0} for c in before), seen
            assert final == {"reduce_scatter": units, "all_reduce": units}, seen
        else:
            assert all(c == {"reduce_scatter": 0, "all_reduce": 0} for c in before), seen
            assert final["all_reduce"] == units and final["reduce_scatter"] == 0, seen


def test_print_gradient_bytes(launch):
    """The measured numbers, for the record (`pytest -s` shows them)."""
    name, results = launch
    for mode in MODES:
        seen = results[0][mode]
        assert len(seen["bytes"]) == MICROBATCHES
        print(f"\n{name} rank 0 {mode}: model {MODEL_GRAD_BYTES} B, after each microbatch {seen['bytes']}")
        if seen["peaks_in_backward"]:
            print(f"{name} rank 0 {mode}: peak inside each backward {seen['peaks_in_backward']}")
