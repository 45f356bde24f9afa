"""Export from and import into FSDP2/HSDP/TP-sharded models on real gloo ranks, against one process."""

import pytest
import torch
import torch._dynamo  # (mesh slicing imports it: once here, not in every forked rank)
import torch.distributed.tensor
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.ckpt import (
    Chunk,
    Deduplicate,
    Identity,
    Parallel,
    Rename,
    RopePermute,
    Sequential,
    Unstack,
    load_safetensors,
    save_safetensors,
)
from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed

SHARD_BYTES = 700


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.qkv(x)[..., :8])


class _Model(nn.Module):
    """Uneven dim 0 (11 rows on 2 ranks), tied embedding/head, bf16 layers next to fp32 root params."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList(_Block().to(torch.bfloat16) for _ in range(2))
        self.experts = nn.Parameter(torch.randn(3, 5, 8))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight


def _build(seed: int) -> _Model:
    torch.manual_seed(seed)
    return _Model()


def _hf_mapper() -> Parallel:
    layers = []
    for i in range(2):
        src, dst = f"layers.{i}.", f"model.layers.{i}.self_attn."
        qkv = Sequential(
            [
                Chunk(src + "qkv.weight", [dst + f"{p}_proj.weight" for p in "qkv"]),
                Parallel(
                    [
                        RopePermute(dst + "q_proj.weight", 4),
                        RopePermute(dst + "k_proj.weight", 4),
                        Identity(dst + "v_proj.weight"),
                    ]
                ),
            ]
        )
        out = [Rename(src + f"out.{p}", dst + f"o_proj.{p}") for p in ("weight", "bias")]
        layers += [qkv, *out]
    experts = Unstack("experts", [f"model.experts.{e}.weight" for e in range(3)])
    tied = Deduplicate(["embed.weight", "head.weight"], "model.embed_tokens.weight")  # HF stores it once
    return Parallel([*layers, experts, tied])


def _shard(model: nn.Module, tp: int, dp_shard: int = 2, dp_replicate: int = 1) -> nn.Module:
    """FSDP2 over dp_shard (HSDP with dp_replicate); with tp=2 each block is first tensor-parallel."""
    ctx = DistributedContext.from_env(
        MeshConfig(data_parallel_replicate=dp_replicate, data_parallel_shard=dp_shard, tensor_parallel=tp),
        device_type="cpu",
    )
    dense = ctx.mesh("dense")
    dp_mesh = dense["dp_replicate", "dp_shard"] if dp_replicate > 1 else dense["dp_shard"]
    for layer in model.layers:
        if tp > 1:
            plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel()}
            parallelize_module(layer, ctx.mesh("dense")["tp"], plan)
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _export_and_import(
    export_dir: str, reference_dir: str, tp: int, dp_shard: int = 2, dp_replicate: int = 1
) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    model = _shard(_build(0), tp, dp_shard, dp_replicate)
    save_safetensors(model, export_dir, mapper=_hf_mapper(), max_shard_size=SHARD_BYTES)
    fresh = _shard(_build(1), tp, dp_shard, dp_replicate)
    load_safetensors(fresh, reference_dir, mapper=_hf_mapper().inverse())
    state = fresh.state_dict()
    local = {
        k: (tuple(v.to_local().shape), repr(v.placements)) for k, v in state.items() if isinstance(v, DTensor)
    }
    full = {k: v.full_tensor() for k, v in state.items()}
    return full, local


@pytest.mark.parametrize(
    ("world_size", "tp", "dp_shard", "dp_replicate"),
    [(2, 1, 2, 1), (4, 1, 4, 1), (4, 1, 2, 2), (4, 2, 2, 1)],
    ids=["fsdp-2ranks", "fsdp-4ranks", "hsdp-2x2-4ranks", "fsdp-x-tp-4ranks"],
)
def test_export_and_import_on_sharded_ranks_match_one_process(
    tmp_path, world_size, tp, dp_shard, dp_replicate
):
    reference, exported = tmp_path / "reference", tmp_path / "sharded"
    model = _build(0)
    save_safetensors(model, reference, mapper=_hf_mapper(), max_shard_size=SHARD_BYTES)
    names = sorted(p.name for p in reference.iterdir())
    assert len(names) > 3  # several shards and the index

    results = run_distributed(
        _export_and_import,
        world_size,
        str(exported),
        str(reference),
        tp,
        dp_shard,
        dp_replicate,
        env={"OMP_NUM_THREADS": "1"},
    )

    assert sorted(p.name for p in exported.iterdir()) == names
    for name in names:
        assert (exported / name).read_bytes() == (reference / name).read_bytes(), name
    expected = model.state_dict()
    rows = {2: [6, 5], 4: [3, 3, 3, 2]}[dp_shard]  # 11 rows, really sharded, unevenly
    for rank, (full, local) in enumerate(results):
        dp_rank = (rank // tp) % dp_shard
        assert local["embed.weight"][0] == (rows[dp_rank], 8)
        if tp > 1:  # 24 rows over tp 2, then dp 2 strided: not one slice of the file
            assert local["layers.0.qkv.weight"] == ((6, 8), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
            assert local["layers.0.out.weight"] == ((4, 4), "(Shard(dim=0), Shard(dim=1))")
        assert set(full) == set(expected)
        for key, tensor in expected.items():
            assert full[key].dtype == tensor.dtype and torch.equal(full[key], tensor), (rank, key)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any floating-point tensor an operation produced (collectives too)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            # Tensors that hold data: not DTensor wrappers (their numel is the global one), not the
            # pickled bytes of objects, not the shape-only dry run on "meta".
            if type(leaf) is torch.Tensor and leaf.is_floating_point() and leaf.device.type != "meta":
                self.largest = max(self.largest, leaf.numel())
        return out


def _export_measuring(export_dir: str, dp_shard: int, dp_replicate: int) -> tuple[int, int, int]:
    model = _shard(_build(0), 1, dp_shard, dp_replicate)
    state = model.state_dict()
    local = max(v.to_local().numel() for v in state.values())
    full = max(v.numel() for v in state.values())
    with _LargestTensor() as mode:
        save_safetensors(model, export_dir, mapper=_hf_mapper(), max_shard_size=SHARD_BYTES)
    return mode.largest, local, full


@pytest.mark.parametrize(
    ("dp_shard", "dp_replicate"),
    [(2, 1), (4, 1), (2, 2)],
    ids=["fsdp-2ranks", "fsdp-4ranks", "hsdp-2x2-4ranks"],
)
def test_only_the_writer_holds_full_tensors(tmp_path, dp_shard, dp_replicate):
    results = run_distributed(
        _export_measuring, dp_shard * dp_replicate, str(tmp_path), dp_shard, dp_replicate,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    (writer_largest, _, full), *others = results
    assert writer_largest >= full  # rank 0 assembles each full tensor
    for rank, (largest, local, full) in enumerate(others, start=1):
        assert largest <= local < full, (rank, largest, local, full)  # never more than its own shard
