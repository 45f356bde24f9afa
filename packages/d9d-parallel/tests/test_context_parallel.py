"""Context-parallel attention: the load-balanced layout, shard/unshard, and forward and backward equal to
full causal attention on one process (cp 2, 3, 4; MHA, GQA, MQA; one token per chunk)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ContextParallel,
    ParallelizeError,
    SequenceLengthError,
    SequenceShare,
    check_sequence_length,
    context_parallel_attention,
    context_parallel_of,
    parallelize_context_parallel,
    sequence_length_problem,
)
from d9d.parallel.context_parallel import _positions

# (batch, q_heads, kv_heads, seq_len as a multiple of 2·cp, head_dim, v_head_dim, scale)
_CASES = [
    (2, 4, 2, 1, 8, 8, None),  # GQA, the smallest sequence: one token per chunk
    (2, 4, 2, 3, 8, 8, None),  # GQA
    (1, 2, 2, 2, 4, 4, 0.3),  # MHA, explicit scale
    (1, 4, 1, 2, 4, 4, None),  # MQA
    (1, 2, 2, 2, 4, 6, None),  # MHA, V with its own head_dim (gathered apart from K)
]


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach() - want.detach()).abs().max())


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference| relative to the tensor's scale (gradients reach |5|; fp32 rounds at 6e-8)."""
    return _max_diff(got, want) / max(1.0, float(want.abs().max()))


def _attention_errors(cp: ContextParallel, seed: int, dtype: torch.dtype) -> list[float]:
    """Per case, the largest relative difference of output and q/k/v grads from one-process attention."""
    errors = []
    for i, (batch, hq, hkv, mult, dim, vdim, scale) in enumerate(_CASES):
        seq = 2 * cp.size * mult
        gen = torch.Generator().manual_seed(seed * 100 + i)
        q, k, v, grad = (
            torch.randn(batch, heads, seq, d, generator=gen, dtype=dtype)
            for heads, d in ((hq, dim), (hkv, dim), (hkv, vdim), (hq, vdim))
        )
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        want.backward(grad)
        local = [cp.shard_sequence(t, dim=2).requires_grad_() for t in (q, k, v)]
        got = context_parallel_attention(*local, cp, scale=scale)
        got.backward(cp.shard_sequence(grad, dim=2))
        diffs = [_rel_diff(got, cp.shard_sequence(want.detach(), dim=2))]
        diffs += [
            _rel_diff(t.grad, cp.shard_sequence(f.grad, dim=2)) for t, f in zip(local, full, strict=True)
        ]
        errors.append(max(diffs))
    return errors


def _layout_checks(cp: ContextParallel) -> dict[str, object]:
    seq = 4 * cp.size
    ids = torch.arange(3 * seq).reshape(3, seq)  # int64, sequence on dim 1
    hidden = torch.randn(2, 3, seq, 5, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 3, seq, 5, generator=torch.Generator().manual_seed(2))
    local = cp.shard_sequence(hidden, dim=2).requires_grad_()
    (cp.unshard_sequence(local, dim=2) * weight).sum().backward()  # every rank uses the whole tensor
    try:
        cp.check_seq_len(100 if 100 % (2 * cp.size) else 102)
        message = None
    except ParallelizeError as exc:
        message = str(exc)
    return {
        "positions": cp.position_ids(seq, "cpu").tolist(),
        "shard_is_positions": torch.equal(cp.shard_sequence(ids), ids[:, cp.position_ids(seq, "cpu")]),
        "ids_round_trip": torch.equal(cp.unshard_sequence(cp.shard_sequence(ids)), ids),
        "bool_round_trip": torch.equal(cp.unshard_sequence(cp.shard_sequence(ids % 3 == 0)), ids % 3 == 0),
        "float_round_trip_dim_minus_2": torch.equal(
            cp.unshard_sequence(cp.shard_sequence(hidden, dim=-2), dim=-2), hidden
        ),
        # the backward sums the cp ranks' gradients and returns each token's to its owner
        "unshard_grad_error": _max_diff(local.grad, cp.size * cp.shard_sequence(weight, dim=2)),
        "check_seq_len": message,
    }


def _rank_main(mesh_shape: tuple[int, ...] | None) -> dict[str, object]:
    world = ContextParallel(dist.group.WORLD)
    out: dict[str, object] = {
        "size": world.size,
        "rank": world.rank,
        "enabled": world.enabled,
        "errors": _attention_errors(world, seed=0, dtype=torch.float32),
        "errors_fp64": _attention_errors(world, seed=0, dtype=torch.float64),
        **_layout_checks(world),
    }
    one_axis = ContextParallel.from_mesh(init_device_mesh("cpu", (world.size,), mesh_dim_names=("cp",)))
    out["one_axis_mesh"] = (one_axis.size, one_axis.rank, dist.get_process_group_ranks(one_axis.group))
    if mesh_shape is not None:  # cp as one axis of a bigger mesh: other rows hold other sequences
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp_shard", "cp"))
        cp = ContextParallel.from_mesh(mesh)
        out["mesh_cp"] = (cp.size, cp.rank, dist.get_process_group_ranks(cp.group))
        out["mesh_errors"] = _attention_errors(
            cp, seed=1 + mesh.get_local_rank("dp_shard"), dtype=torch.float32
        )
        out["cp1_enabled"] = ContextParallel.from_mesh(
            init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp_shard", "cp"))
        ).enabled
        try:
            ContextParallel.from_mesh(
                init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
            )
        except ParallelizeError as exc:
            out["no_cp_axis"] = str(exc)
    return out


@pytest.mark.parametrize(("world_size", "mesh_shape"), [(2, None), (3, None), (4, (2, 2))])
def test_cp_attention_matches_one_process_world_2_3_4(world_size, mesh_shape):
    results = run_distributed(_rank_main, world_size, mesh_shape)
    seq = 4 * world_size
    for rank, got in enumerate(results):
        assert (got["size"], got["rank"], got["enabled"]) == (world_size, rank, True)
        assert max(got["errors"]) <= 1e-6, got["errors"]
        assert max(got["errors_fp64"]) <= 1e-12, got["errors_fp64"]  # exact up to rounding
        assert got["positions"] == _positions(seq, world_size, rank).tolist()
        assert got["shard_is_positions"] and got["ids_round_trip"] and got["bool_round_trip"]
        assert got["float_round_trip_dim_minus_2"]
        assert got["unshard_grad_error"] <= 1e-6
        assert got["one_axis_mesh"] == (world_size, rank, list(range(world_size)))
        chunks, bad = 2 * world_size, 100 if 100 % (2 * world_size) else 102
        assert got["check_seq_len"] == (
            f"a sequence has {bad} tokens, not divisible by 2 × mesh.context_parallel = {chunks} (context "
            f"parallelism cuts each sequence into {chunks} equal chunks); make the dataset's sequence length "
            f"(e.g. dataset.seq_len) a multiple of {chunks} or change mesh.context_parallel"
        )
        if mesh_shape is not None:
            row = rank // mesh_shape[1]
            cp_ranks = [row * mesh_shape[1] + i for i in range(mesh_shape[1])]
            assert got["mesh_cp"] == (mesh_shape[1], rank % mesh_shape[1], cp_ranks)
            assert max(got["mesh_errors"]) <= 1e-6, got["mesh_errors"]
            assert got["cp1_enabled"] is False
            assert "has no axis 'cp'" in got["no_cp_axis"]
    # the whole sequence, each position exactly once
    everything = sorted(p for got in results for p in got["positions"])
    assert everything == list(range(seq))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_layout_is_balanced(size):
    """Every rank holds 2 chunks and the same number of allowed (query, key) pairs under causality."""
    seq = 2 * size * 3
    pairs = set()
    for rank in range(size):
        positions = _positions(seq, size, rank)
        assert len(positions) == seq // size
        pairs.add(int((positions + 1).sum()))  # query p sees keys 0..p
    assert len(pairs) == 1
    assert _positions(16, 4, 1).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8


def test_disabled_is_plain_causal_attention():
    for cp in (ContextParallel.from_mesh(None), ContextParallel(None)):
        assert (cp.size, cp.rank, cp.enabled, cp.group) == (1, 0, False, None)
        cp.check_seq_len(7)  # no layout constraint without context parallelism
        x = torch.randn(2, 7)
        assert cp.shard_sequence(x) is x and cp.unshard_sequence(x) is x
        assert cp.position_ids(7, "cpu").tolist() == list(range(7))
        gen = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(2, 4, 7, 8, generator=gen), *torch.randn(2, 2, 2, 7, 8, generator=gen)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(context_parallel_attention(q, k, v, cp), want)
        assert torch.equal(context_parallel_attention(q, k, v, None), want)
        want_mha = F.scaled_dot_product_attention(q, q, q, is_causal=True, scale=0.5)
        assert torch.equal(context_parallel_attention(q, q, q, cp, scale=0.5), want_mha)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), r"\[batch, heads, seq, head_dim\]"),
        (((1, 4, 8, 4), (1, 2, 6, 4), (1, 2, 6, 4)), "same batch and local sequence length"),
        (((1, 4, 8, 4), (1, 3, 8, 4), (1, 3, 8, 4)), "kv_heads 3 must divide q_heads 4"),
    ],
)
def test_bad_shapes_are_refused(shapes, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ParallelizeError, match=match):
        context_parallel_attention(q, k, v, None)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.context_parallel = None


def _wiring() -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = torch.nn.Sequential(_Attention(), torch.nn.Linear(4, 4), _Attention())
    cp = parallelize_context_parallel(model, mesh)
    with pytest.raises(ParallelizeError, match="no module of Sequential supports context parallelism"):
        parallelize_context_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), mesh)
    batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8) + 100,
             "doc_weight": torch.ones(1, 3), "scalar": 5}  # fmt: skip
    local = cp.shard_batch(batch)
    with pytest.raises(
        SequenceLengthError, match=r"a sequence has 6 tokens, not divisible by 2 × mesh\.context_parallel = 4"
    ):
        cp.shard_batch({"input_ids": torch.zeros(1, 6)})
    return {
        "set": [m.context_parallel is cp for m in (model[0], model[2])],
        "found": context_parallel_of(model) is cp,
        "copied_keeps_group": copy.deepcopy(model)[0].context_parallel is cp,
        "input_ids": local["input_ids"].tolist(),
        "labels": local["labels"].tolist(),
        "untouched": local["doc_weight"].shape == (1, 3) and local["scalar"] == 5,
    }


def test_parallelize_context_parallel_sets_the_group_and_shard_batch_splits_every_sequence_tensor():
    results = run_distributed(_wiring, 2)
    for rank, got in enumerate(results):
        positions = _positions(8, 2, rank).tolist()
        assert got["set"] == [True, True] and got["found"] and got["copied_keeps_group"]
        assert got["input_ids"] == [positions] and got["labels"] == [[p + 100 for p in positions]]
        assert got["untouched"]
    off = torch.nn.Sequential(_Attention())
    assert not parallelize_context_parallel(off, None).enabled and off[0].context_parallel is None
    assert context_parallel_of(off) is None


def test_sequence_share_is_chunks_r_and_its_mirror_and_positions_follow_it():
    share = SequenceShare(16, 2, 1)
    assert (share.num_chunks, share.chunks, share.chunk_tokens, share.local_tokens) == (4, (1, 2), 4, 8)
    assert _positions(16, 2, 1).tolist() == [*range(4, 8), *range(8, 12)]
    whole = SequenceShare(10, 1, 0)
    assert (whole.num_chunks, whole.chunks, whole.local_tokens) == (1, (0,), 10)


def test_one_sequence_length_rule_names_the_source_and_the_fix():
    assert sequence_length_problem(16, 2) is None
    assert sequence_length_problem(7, 1) is None  # no context parallelism: any length
    message = sequence_length_problem(10, 2, subject="--seq-len gives", fix="pass")
    assert message == (
        "--seq-len gives 10 tokens, not divisible by 2 × mesh.context_parallel = 4 (context parallelism "
        "cuts each sequence into 4 equal chunks); pass a multiple of 4 or change mesh.context_parallel"
    )
    assert sequence_length_problem(0, 2) is not None
    with pytest.raises(SequenceLengthError, match=r"eval_dataset\.seq_len to a multiple of 4"):
        check_sequence_length(
            6, 2, subject="the eval set's sequences have", fix="set eval_dataset.seq_len to"
        )
    assert issubclass(SequenceLengthError, ParallelizeError)
