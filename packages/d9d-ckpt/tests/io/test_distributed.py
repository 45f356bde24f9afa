"""Export from and import into an FSDP2-sharded model on 2 real ranks (gloo), against one process."""

import pytest
import torch
import torch._dynamo  # (mesh slicing imports it: once here, not in every forked rank)
import torch.distributed.tensor
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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


def _shard(model: nn.Module, tp: int) -> nn.Module:
    """FSDP2 over dp_shard=2; with tp=2 each block is first tensor-parallel (qkv colwise, out rowwise)."""
    ctx = DistributedContext.from_env(
        MeshConfig(data_parallel_shard=2, tensor_parallel=tp), device_type="cpu"
    )
    dp_mesh = ctx.mesh("dense")["dp_shard"]
    for layer in model.layers:
        if tp > 1:
            plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel()}
            parallelize_module(layer, ctx.mesh("dense")["tp"], plan)
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _export_and_import(
    export_dir: str, reference_dir: str, tp: int
) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    model = _shard(_build(0), tp)
    save_safetensors(model, export_dir, mapper=_hf_mapper(), max_shard_size=SHARD_BYTES)
    fresh = _shard(_build(1), tp)
    load_safetensors(fresh, reference_dir, mapper=_hf_mapper().inverse())
    state = fresh.state_dict()
    local = {
        k: (tuple(v.to_local().shape), repr(v.placements)) for k, v in state.items() if isinstance(v, DTensor)
    }
    full = {k: v.full_tensor() for k, v in state.items()}
    return full, local


@pytest.mark.parametrize(("world_size", "tp"), [(2, 1), (4, 2)], ids=["fsdp-2ranks", "fsdp-x-tp-4ranks"])
def test_export_and_import_on_sharded_ranks_match_one_process(tmp_path, world_size, tp):
    reference, exported = tmp_path / "reference", tmp_path / "sharded"
    model = _build(0)
    save_safetensors(model, reference, mapper=_hf_mapper(), max_shard_size=SHARD_BYTES)
    names = sorted(p.name for p in reference.iterdir())
    assert len(names) > 3  # several shards and the index

    results = run_distributed(
        _export_and_import, world_size, str(exported), str(reference), tp, env={"OMP_NUM_THREADS": "1"}
    )

    assert sorted(p.name for p in exported.iterdir()) == names
    for name in names:
        assert (exported / name).read_bytes() == (reference / name).read_bytes(), name
    expected = model.state_dict()
    for rank, (full, local) in enumerate(results):
        dp_rank = rank // tp
        assert local["embed.weight"][0] == (6 - dp_rank, 8)  # really sharded, unevenly
        if tp > 1:  # 24 rows over tp 2, then dp 2 strided: not one slice of the file
            assert local["layers.0.qkv.weight"] == ((6, 8), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
            assert local["layers.0.out.weight"] == ((4, 4), "(Shard(dim=0), Shard(dim=1))")
        assert set(full) == set(expected)
        for key, tensor in expected.items():
            assert full[key].dtype == tensor.dtype and torch.equal(full[key], tensor), (rank, key)
