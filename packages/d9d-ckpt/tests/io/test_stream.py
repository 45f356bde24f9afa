"""`stream_weights`: the tensors `save_safetensors` writes, in buckets, from sharded gloo ranks as from
one process; only the receiving ranks hold full tensors."""

import itertools

import pytest
import torch
import torch._dynamo  # (mesh slicing imports it: once here, not in every forked rank)
import torch.distributed.tensor
from safetensors.torch import load_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from d9d.ckpt import (
    Chunk,
    Deduplicate,
    Parallel,
    Rename,
    SafetensorsIOError,
    Unstack,
    save_safetensors,
    stream_weights,
)
from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed

BUCKET = 600


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(8, 32, bias=False)  # gate and up fused, as HF stores them apart
        self.down = nn.Linear(16, 8)


class _Net(nn.Module):
    """A tied embedding/head (13 rows: uneven shards), bf16 MLPs, a stacked expert bank, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(13, 8)
        self.mlps = nn.ModuleList(_Mlp().to(torch.bfloat16) for _ in range(2))
        self.bank = nn.Parameter(torch.randn(4, 3, 8))
        self.lm = nn.Linear(8, 13, bias=False)
        self.lm.weight = self.tok.weight
        self.register_buffer("counts", torch.arange(5))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _to_hf() -> Parallel:
    parts = [
        Deduplicate(["tok.weight", "lm.weight"], "model.embed_tokens.weight"),
        Unstack("bank", [f"model.experts.{e}.weight" for e in range(4)]),
        Rename("counts", "model.counts"),
    ]
    for i in range(2):
        src, dst = f"mlps.{i}.", f"model.layers.{i}.mlp."
        parts.append(Chunk(src + "gate_up.weight", [dst + "gate_proj.weight", dst + "up_proj.weight"]))
        parts += [Rename(src + f"down.{p}", dst + f"down_proj.{p}") for p in ("weight", "bias")]
    return Parallel(parts)


class _Largest(TorchDispatchMode):
    """The most elements of any plain floating tensor an op made (DTensor wrappers and meta left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if type(leaf) is torch.Tensor and leaf.is_floating_point() and leaf.device.type != "meta":
                self.largest = max(self.largest, leaf.numel())
        return out


def _stream_sharded(destination: str) -> tuple[list[list[tuple[str, torch.Tensor]]], int, int]:
    """FSDP 2 x TP 2 on 4 ranks: this rank's buckets, the largest tensor it made, its largest shard."""
    ctx = DistributedContext.from_env(MeshConfig(data_parallel_shard=2, tensor_parallel=2), device_type="cpu")
    model = _net()
    for mlp in model.mlps:
        parallelize_module(
            mlp, ctx.mesh("dense")["tp"], {"gate_up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        fully_shard(mlp, mesh=ctx.mesh("dense")["dp_shard"])
    fully_shard(model, mesh=ctx.mesh("dense")["dp_shard"])
    local = max(v.to_local().numel() if isinstance(v, DTensor) else 0 for v in model.state_dict().values())
    with _Largest() as seen:
        buckets = list(
            stream_weights(
                model, mapper=_to_hf(), dtype=torch.float16, bucket_bytes=BUCKET, destination=destination
            )  # type: ignore[arg-type]
        )
    return buckets, seen.largest, local


@pytest.mark.parametrize("destination", ["rank0", "all"])
def test_sharded_ranks_stream_what_one_process_writes(tmp_path, destination):
    save_safetensors(_net(), tmp_path, mapper=_to_hf())
    written = load_file(tmp_path / "model.safetensors")
    one = list(
        stream_weights(
            _net(), mapper=_to_hf(), dtype=torch.float16, bucket_bytes=BUCKET, keep_dtype=["counts"]
        )
    )
    results = run_distributed(_stream_sharded, 4, destination, env={"OMP_NUM_THREADS": "1"})
    assert {len(buckets) for buckets, _, _ in results} == {len(one)}
    flat = dict(p for b in one for p in b)
    assert sorted(flat) == sorted(written)
    for name, tensor in written.items():
        expected_dtype = tensor.dtype if not tensor.is_floating_point() else torch.float16
        assert flat[name].dtype == expected_dtype and torch.equal(flat[name], tensor.to(expected_dtype)), name
    for bucket in one:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET or len(bucket) == 1
    for rank, (buckets, largest, local) in enumerate(results):
        if rank == 0 or destination == "all":
            assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in one]
            for (name, got), (_, want) in zip(
                (p for b in buckets for p in b), (p for b in one for p in b), strict=True
            ):
                assert got.dtype == want.dtype and torch.equal(got, want), (rank, name)
        else:
            assert all(b == [] for b in buckets)
            assert largest <= local, (rank, largest, local)  # never more than its own shard


def test_a_tensor_over_the_bucket_size_is_a_bucket_of_its_own():
    buckets = list(stream_weights(_net(), mapper=_to_hf(), bucket_bytes=300))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert any(s > 300 for s in sizes)
    assert all(s <= 300 or len(b) == 1 for s, b in zip(sizes, buckets, strict=True))
    assert all(a + b > 300 for a, b in itertools.pairwise(sizes))  # no two would fit in one


def test_floating_buffers_named_in_keep_dtype_keep_it():
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    kept, cast = (
        dict(p for b in stream_weights(model, dtype=torch.bfloat16, keep_dtype=keep) for p in b)
        for keep in (["scale"], [])
    )
    assert kept["scale"].dtype == torch.float64 and cast["scale"].dtype == torch.bfloat16
    assert kept["0.weight"].dtype == cast["0.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_bytes": 0}, "bucket_bytes must be a positive number of bytes, got 0"),
        ({"destination": "rank1"}, "destination must be 'rank0' or 'all', got 'rank1'"),
        ({"dtype": torch.int8}, "dtype torch.int8 is not a floating dtype"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(SafetensorsIOError, match=message):
        stream_weights(_net(), **kwargs)


def test_the_streamed_tensors_are_a_snapshot_not_the_models_memory():
    model = _net()
    streamed = dict(p for b in stream_weights(model, mapper=_to_hf()) for p in b)  # float32: no cast
    before = {name: t.clone() for name, t in streamed.items()}
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(1)  # a training step after the stream
    for name, tensor in streamed.items():
        assert torch.equal(tensor, before[name]), name
