"""`Trainer.stream_weights`: the export's tensors, in buckets, from every mesh, loaded into transformers.

Each mesh trains the tiny quickstart one step (forked ranks, gloo), exports it, and streams it three
times: in float32 (kept, to load), in bfloat16 (kept, to check the cast), and in bfloat16 under
`StoragePeak` with every bucket dropped once seen (the peak extra memory of streaming, per rank).
The float32 buckets are loaded one by one (`load_state_dict(strict=False)`) into a transformers model
built from the export's config.json; its logits must equal those of the export loaded by
transformers, and the streamed tensors the exported ones.
"""

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from _quickstart import CONFIG, MOE, SGD, exported_weights, overrides, run_forked
from _storage_peak import StoragePeak

from d9d.mesh.testing import run_distributed
from d9d.trainer import ReferenceModelProvider

#: ~0.72 MB of float32 weights in 25 tensors; buckets of 64 KiB (the embedding is one of its own).
SIZE = ["model.num_layers=4", "trainer.checkpointing.period_steps=0"]
BUCKET = 64 * 2**10
#: Every projection adapted: merging them all at once would hold 0.4 of the model per rank (FSDP 2).
LORA = r"peft.lora={rank: 4, alpha: 8, target_modules: ['.*_proj']}"
MESHES = {
    "fsdp2": (2, ["mesh.data_parallel_shard=2"]),
    "tp2": (2, ["mesh.tensor_parallel=2"]),
    "pp2": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]),
    "ep2_moe": (2, ["mesh.data_parallel_shard=2", "mesh.expert_parallel=2", *MOE]),
    "fsdp2_lora": (2, ["mesh.data_parallel_shard=2", LORA, "export.lora=merged", *SGD]),
}


class NoMapperProvider(ReferenceModelProvider):
    """Exports the model's own names (`mapper=None`), so a buffer added to the model is exported too."""

    def prepare_export_model_stage(self, context):
        from d9d.trainer.providers import PrepareExportModelStageResult

        return PrepareExportModelStageResult(mapper=None)


@pytest.fixture(scope="module", autouse=True)
def _imported():
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)


def _stream_three_ways(args: list[str], destination: str) -> dict[str, Any]:
    """Train, export, and stream (float32 and bfloat16 kept; bfloat16 measured); this rank's buckets."""
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
        trainer.export()
        kept = {
            name: [list(b) for b in trainer.stream_weights(dtype, BUCKET, destination)]  # type: ignore[arg-type]
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }
        counts = []
        with StoragePeak(exclude=trainer.model.state_dict(keep_vars=True).values()) as peak:
            for bucket in trainer.stream_weights(torch.bfloat16, BUCKET, destination):  # type: ignore[arg-type]
                counts.append(len(bucket))
                del bucket
        return {**kept, "peak": peak.peak, "counts": counts}


def _run(tmp_path: Path, nproc: int, sets: list[str], destination: str = "rank0") -> list[dict[str, Any]]:
    export = tmp_path / "export"
    args = overrides(tmp_path, "run", 1, *SIZE, *sets, f"export.dir={export}")
    if nproc == 1:
        return [run_forked(_stream_three_ways, args, destination, timeout=120)]
    return run_distributed(_stream_three_ways, nproc, args, destination, timeout=120)


def _check_buckets(buckets: list[list[tuple[str, torch.Tensor]]], dtype: torch.dtype) -> None:
    """Every bucket within BUCKET bytes (or one tensor alone), every tensor in `dtype`."""
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (size, [n for n, _ in bucket])
        assert all(t.dtype == dtype for _, t in bucket), [(n, t.dtype) for n, t in bucket]
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    # packed: no two neighbouring buckets would have fit in one
    assert all(a + b > BUCKET for a, b in itertools.pairwise(sizes)), sizes


def _load_streamed(export: Path, buckets: list[list[tuple[str, torch.Tensor]]]) -> Any:
    """A transformers model from the export's config.json, its weights loaded bucket by bucket."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(export)
    model = transformers.AutoModelForCausalLM.from_config(config)  # random weights, rotary buffers set
    expected = model.state_dict()
    loaded: set[str] = set()
    for bucket in buckets:
        result = model.load_state_dict(dict(bucket), strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        loaded |= {name for name, _ in bucket}
    storages = {expected[k].untyped_storage().data_ptr() for k in loaded}
    missing = [
        k for k in expected if k not in loaded and expected[k].untyped_storage().data_ptr() not in storages
    ]
    assert not missing, f"the stream left {missing} of the transformers model unset"
    model.tie_weights()
    return model.eval()


def _load_streamed_folder(export: Path, buckets: list[list[tuple[str, torch.Tensor]]], folder: Path) -> Any:
    """transformers 5 fuses an MoE layer's experts as it loads a folder (its conversion mapping), so
    their per-expert names (vLLM's) go through a folder: the streamed tensors, the export's config.json."""
    from safetensors.torch import save_file

    transformers = pytest.importorskip("transformers")
    folder.mkdir()
    (folder / "config.json").write_bytes((export / "config.json").read_bytes())
    save_file({name: t.contiguous() for b in buckets for name, t in b}, folder / "model.safetensors")
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _check_stream(tmp_path: Path, ranks: list[dict[str, Any]], receivers: list[int]) -> None:
    transformers = pytest.importorskip("transformers")
    export = tmp_path / "export"
    files = exported_weights(export)
    counts = (
        {len(r["fp32"]) for r in ranks},
        {len(r["bf16"]) for r in ranks} | {len(r["counts"]) for r in ranks},
    )
    assert all(len(c) == 1 for c in counts), f"ranks iterated different numbers of buckets: {counts}"
    for rank, result in enumerate(ranks):
        if rank not in receivers:
            assert all(not b for b in result["fp32"] + result["bf16"]) and set(result["counts"]) == {0}
            continue
        fp32, bf16 = result["fp32"], result["bf16"]
        _check_buckets(fp32, torch.float32)
        _check_buckets(bf16, torch.bfloat16)
        names = [n for b in fp32 for n, _ in b]
        assert names == [n for b in bf16 for n, _ in b] and sorted(names) == sorted(files)
        streamed, cast = dict(p for b in fp32 for p in b), dict(p for b in bf16 for p in b)
        for name, tensor in files.items():
            assert torch.equal(streamed[name], tensor), name
            assert torch.equal(cast[name], tensor.to(torch.bfloat16)), name
        fused = any(".experts.0." in name for name in names)
        model = (
            _load_streamed_folder(export, fp32, tmp_path / f"s{rank}")
            if fused
            else _load_streamed(export, fp32)
        )
        reference = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
        ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def _assert_peak(tmp_path: Path, ranks: list[dict[str, Any]], what: str) -> None:
    """The most bytes any rank held for the stream (bfloat16, 64 KiB buckets), as a share of the float32
    model: one bucket plus one group's full tensors, not the model (0.5 would be all of it in bfloat16)."""
    model = sum(t.numel() * t.element_size() for t in exported_weights(tmp_path / "export").values())
    ratio = max(r["peak"] for r in ranks) / model
    print(f"{what}: peak {ratio:.3f} of the model's {model} bytes")
    assert ratio < 0.35, f"streaming held {ratio:.2f} of the model's bytes at its peak"


def test_one_process_streams_the_export_in_buckets(tmp_path):
    ranks = _run(tmp_path, 1, [])
    _check_stream(tmp_path, ranks, receivers=[0])
    assert len(ranks[0]["fp32"]) > 5  # the bucket size split the model
    _assert_peak(tmp_path, ranks, "one process")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_mesh_streams_the_export_to_rank_0(tmp_path, mesh):
    nproc, sets = MESHES[mesh]
    ranks = _run(tmp_path, nproc, sets)
    _check_stream(tmp_path, ranks, receivers=[0])
    _assert_peak(tmp_path, ranks, mesh)  # a LoRA run's weights too: merged one at a time


def test_destination_all_gives_every_rank_the_buckets(tmp_path):
    ranks = _run(tmp_path, 2, MESHES["fsdp2"][1], destination="all")
    _check_stream(tmp_path, ranks, receivers=[0, 1])
    _assert_peak(tmp_path, ranks, "fsdp2, destination all")


def _stream_with_a_buffer(args: list[str]) -> dict[str, torch.dtype]:
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.model.register_buffer("scale", torch.ones(4, dtype=torch.float32))  # a persistent buffer
        return {n: t.dtype for b in trainer.stream_weights(torch.bfloat16, BUCKET) for n, t in b}


def test_the_trainers_buffers_keep_their_dtype(tmp_path):
    args = overrides(tmp_path, "run", 1, f"providers.model={__file__}:NoMapperProvider")
    dtypes = run_forked(_stream_with_a_buffer, args, timeout=120)
    assert dtypes.pop("scale") == torch.float32
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, dtypes
