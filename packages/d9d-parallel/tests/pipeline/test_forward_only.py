"""`Pipeline.forward_only` (evaluation through the stages): on every schedule's layout, each
microbatch's last-stage output equals the whole model's forward in one process, for microbatch
counts and shapes other than the training step's, after a training step; both ranks post their
transfers in the same order (else a pair on one ordered stream, as NCCL's, would hang: sending each
output at once failed this on the loop layouts); and nothing it made outlives the call (no tensor
saved for backward, no storage held but its returned outputs).

Two forked ranks over gloo. Measured: outputs identical to one process (fp32, the same ops in the
same order), 0 bytes saved and 0 bytes alive after every call, on every schedule.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _alive_storages import StorageCensus
from _pipeline_model import SCHEDULE_CASES, SEQ, TinyConfig, batches, build_stage, loss_fn
from _saved_tensors import SavedTensors

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import Pipeline, PipelineConfig, PipelineError, plan_pipeline

ATOL = 1e-6  # the same ops in the same order as one process; a matmul's sums may split across threads
# differently in the forked ranks (one thread) and the reference (the test process's): 2.4e-7 seen
#: Eval microbatches unlike the step's (4 rows of SEQ): other counts, row counts and lengths.
EVAL_SHAPES = [(3, SEQ), (1, SEQ), (2, SEQ - 3)]


def _eval_inputs(cfg: TinyConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, cfg.vocab_size, shape, generator=gen) for shape in EVAL_SHAPES]


@contextlib.contextmanager
def _transfers() -> Iterator[list[str]]:
    """The point-to-point transfers of this rank in the order it posts them, each named by its
    direction between group ranks ("0>1": from 0 to 1), whichever side posts it."""
    order: list[str] = []
    me = dist.get_rank()
    isend, recv = dist.isend, dist.recv

    def recorded_isend(tensor: torch.Tensor, *args: Any, group_dst: int, **kwargs: Any) -> Any:
        order.append(f"{me}>{group_dst}")
        return isend(tensor, *args, group_dst=group_dst, **kwargs)

    def recorded_recv(tensor: torch.Tensor, *args: Any, group_src: int, **kwargs: Any) -> Any:
        order.append(f"{group_src}>{me}")
        return recv(tensor, *args, group_src=group_src, **kwargs)

    dist.isend, dist.recv = recorded_isend, recorded_recv
    try:
        yield order
    finally:
        dist.isend, dist.recv = isend, recv


def _forward_only_per_schedule() -> dict[str, object]:
    cfg = TinyConfig()
    tokens, inputs = batches(cfg), _eval_inputs(cfg)
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=2)) as ctx:
        pp_rank = ctx.coordinate("pp")
        found: dict[str, object] = {}
        for schedule, stages_per_rank, n in SCHEDULE_CASES:
            layout = plan_pipeline(
                cfg.n_layers, 2, PipelineConfig(schedule, stages_per_rank), n_microbatches=n
            )
            modules = [build_stage(cfg, spec) for spec in layout.stages_of_rank(pp_rank)]
            pipe = Pipeline(
                layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=n, loss_fn=loss_fn
            )
            micro = list(tokens[0].chunk(n))
            positions = torch.arange(SEQ)
            pipe.step(
                [m[:, :-1] for m in micro], [m[:, 1:] for m in micro], kwargs=[{"positions": positions}] * n
            )
            with torch.no_grad():  # a training step's update, so the eval sees trained stages
                for module in modules:
                    for p in module.parameters():
                        p.sub_(0.5 * p.grad)
                        p.grad = None
            saved, census = SavedTensors(), StorageCensus()
            with saved.recording(), census, _transfers() as order:
                outputs = pipe.forward_only(
                    inputs, kwargs=[{"positions": torch.arange(x.shape[1])} for x in inputs]
                )
            got = [o.clone() for o in outputs] if outputs is not None else None
            params = [p for m in modules for p in m.parameters()]
            found[f"{schedule} x{stages_per_rank}"] = {
                "outputs": got,
                "saved": saved.packed_bytes,
                "alive": census.alive([*params, *(outputs or [])])[0],
                "seen": census.seen,
                "stages": {k: v.clone() for m in modules for k, v in m.state_dict().items()},
                "order": order,
            }
            del outputs
        return found


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, object]]:
    return run_distributed(_forward_only_per_schedule, 2, timeout=300)


@pytest.mark.parametrize("case", [f"{s} x{k}" for s, k, _ in SCHEDULE_CASES])
def test_forward_only_equals_the_whole_model_on_every_schedule_2ranks(ranks, case):
    cfg = TinyConfig()
    whole = build_stage(cfg, None)
    state = {k: v for rank in ranks for k, v in rank[case]["stages"].items()}
    whole.load_state_dict(state)  # the stages' trained weights, put together
    holders = [rank[case]["outputs"] for rank in ranks if rank[case]["outputs"] is not None]
    assert len(holders) == 1, f"{case}: {len(holders)} ranks returned outputs (the last stage's rank only)"
    with torch.no_grad():
        expected = [whole(x, torch.arange(x.shape[1])) for x in _eval_inputs(cfg)]
    assert [tuple(o.shape) for o in holders[0]] == [tuple(e.shape) for e in expected]
    for got, want in zip(holders[0], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("case", [f"{s} x{k}" for s, k, _ in SCHEDULE_CASES])
def test_both_ranks_post_their_transfers_in_one_order_2ranks(ranks, case):
    """Where a pair's sends and receives share one ordered stream (NCCL), a rank whose next transfer
    with its peer is not the peer's next one waits forever: both must post the same sequence (gloo,
    which does not order them, would not hang; this checks the order itself)."""
    orders = [rank[case]["order"] for rank in ranks]
    assert orders[0] and orders[0] == orders[1], (
        f"{case}: the ranks post their transfers in other orders: {orders}"
    )


@pytest.mark.parametrize("case", [f"{s} x{k}" for s, k, _ in SCHEDULE_CASES])
def test_forward_only_keeps_nothing_2ranks(ranks, case):
    for pp_rank, rank in enumerate(ranks):
        found = rank[case]
        assert found["seen"] > 0, f"rank {pp_rank} ({case}): the census saw nothing of the call"
        assert found["saved"] == 0, f"rank {pp_rank} ({case}): {found['saved']} bytes saved for backward"
        assert found["alive"] == 0, f"rank {pp_rank} ({case}): {found['alive']} bytes alive after the call"


def _mismatched_kwargs() -> str:
    cfg = TinyConfig()
    with DistributedContext.from_env(MeshConfig(pipeline_parallel=2)) as ctx:
        layout = plan_pipeline(cfg.n_layers, 2, PipelineConfig("1f1b"), n_microbatches=2)
        modules = [build_stage(cfg, spec) for spec in layout.stages_of_rank(ctx.coordinate("pp"))]
        pipe = Pipeline(layout, modules, pp_group=ctx.mesh("dense")["pp"], n_microbatches=2, loss_fn=loss_fn)
        try:
            pipe.forward_only(_eval_inputs(cfg), kwargs=[{}])
        except PipelineError as exc:
            return str(exc)
        return "no error"


def test_forward_only_refuses_kwargs_of_another_count_2ranks():
    for message in run_distributed(_mismatched_kwargs, 2, timeout=120):
        assert "3 microbatch inputs but 1 kwargs" in message
