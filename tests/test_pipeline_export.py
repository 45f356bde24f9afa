"""`Trainer.export()` from a pipeline-parallel run writes the files one process writes from the same
weights: the run's final checkpoint exported by `d9d export RUN_DIR` in one process (which reshards
it) is the reference, and every file (safetensors shards, index, config.json) must be byte-equal.

The model is sized past `export.shard_size_mb=1` so the export is split into several files, some
holding tensors of both stages. Ranks are forked from the test process (`_quickstart.train`).
"""

import json
from pathlib import Path

import pytest
import torch
from _quickstart import MOE, overrides, quickstart_train_module, run_forked, train

from d9d.ckpt.io._gather import merge_key_orders
from d9d.mesh.testing import run_distributed
from d9d.parallel.pipeline import StageSpec

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: ~2.3 MB of fp32 weights: three files of at most 1 MB.
SIZE = ["model.hidden_size=128", "model.intermediate_size=512", "export.shard_size_mb=1"]
PP2 = ["mesh.pipeline_parallel=2", "pipelining.schedule=1f1b"]
MESHES = {
    "pp2": (2, PP2, []),
    "pp2_fsdp2": (4, [*PP2, "mesh.data_parallel_shard=2"], []),
    "pp2_moe": (2, PP2, MOE),
    "pp2_fsdp2_ep2_moe": (4, [*PP2, "mesh.data_parallel_shard=2", "mesh.expert_parallel=2"], MOE),
    # two chunks per rank: the loop placement and the V (the first rank holds embedding and head)
    "pp2_interleaved": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=interleaved_1f1b"], []),
    "pp2_zbv": (2, ["mesh.pipeline_parallel=2", "pipelining.schedule=zbv"], []),
}


class StageMapperProvider(quickstart_train_module().QuickstartModelProvider):
    """Exports through a mapper built from the stage's own keys (so each pp rank returns another)."""

    def prepare_export_model_stage(self, context):
        from d9d.ckpt import Parallel, Rename

        keys = list(context.model.state_dict())
        return self._result(Parallel([Rename(k, k.replace("model.", "backbone.", 1)) for k in keys]))

    @staticmethod
    def _result(mapper):
        from d9d.trainer.providers import PrepareExportModelStageResult

        return PrepareExportModelStageResult(mapper=mapper)


class NoMapperProvider(StageMapperProvider):
    """Exports the model's own names (`mapper=None`, as the `d9d init` template does)."""

    def prepare_export_model_stage(self, context):
        return self._result(None)


@pytest.fixture(scope="module", autouse=True)
def _imported():
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)


def _cli_export(run_dir: Path, out: Path) -> None:
    from d9d.cli._group import cli

    cli.main(["export", str(run_dir), "--out", str(out)], prog_name="d9d", standalone_mode=False)


def _export_one_process(run_dir: Path, out: Path) -> None:
    """`d9d export RUN_DIR --out OUT` in a fresh one-process run (no process group): the reference."""
    run_forked(_cli_export, run_dir, out, timeout=120)


def _pipelined_and_reference(tmp_path: Path, nproc: int, args: list[str]) -> tuple[Path, Path]:
    """Train 2 steps on the pp mesh, exporting at the end; then export its checkpoint in one process."""
    exported, reference = tmp_path / "pipelined", tmp_path / "reference"
    train(nproc, overrides(tmp_path, "run", 2, *SIZE, *args, f"export.dir={exported}"), timeout=120)
    _export_one_process(tmp_path / "run", reference)
    return exported, reference


def _assert_same_files(exported: Path, reference: Path) -> list[str]:
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in exported.iterdir()) == names
    for name in names:
        assert (exported / name).read_bytes() == (reference / name).read_bytes(), name
    return names


@pytest.mark.parametrize("mesh", list(MESHES))
def test_pipelined_export_is_byte_identical_to_one_process(tmp_path, mesh):
    nproc, degrees, model = MESHES[mesh]
    exported, reference = _pipelined_and_reference(tmp_path, nproc, [*model, *degrees])
    names = _assert_same_files(exported, reference)
    assert "config.json" in names and "model.safetensors.index.json" in names
    weight_map = json.loads((reference / "model.safetensors.index.json").read_text())["weight_map"]
    stages_per_file: dict[str, set[bool]] = {}
    for key, file in weight_map.items():
        stages_per_file.setdefault(file, set()).add("layers.0." in key or "embed" in key)  # stage 0?
    assert len(stages_per_file) >= 2 and {True, False} in stages_per_file.values()  # a file spans stages
    if model:  # the HF mapper splits each layer's stacked experts into one tensor per expert
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in weight_map


def test_read_only_export_of_a_pipelined_checkpoint_on_its_own_mesh(tmp_path):
    """`d9d export` under torchrun keeps the checkpoint's pp mesh: a read-only pipelined Trainer."""
    exported, reference = _pipelined_and_reference(tmp_path, 2, PP2)
    again = tmp_path / "read_only"
    run_distributed(_cli_export, 2, tmp_path / "run", again, timeout=120)
    _assert_same_files(again, reference)
    _assert_same_files(again, exported)


@pytest.mark.parametrize(
    "provider", [StageMapperProvider, NoMapperProvider], ids=["stage_mapper", "no_mapper"]
)
def test_pipelined_export_with_per_stage_or_no_mapper(tmp_path, provider):
    spec = f"providers.model={__file__}:{provider.__name__}"
    exported, reference = _pipelined_and_reference(tmp_path, 2, [spec, *PP2])
    _assert_same_files(exported, reference)
    keys = json.loads((reference / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "backbone." if provider is StageMapperProvider else "model."
    assert f"{prefix}layers.1.mlp.up_proj.weight" in keys and "lm_head.weight" in keys


@pytest.mark.parametrize(
    "stages_of_rank",
    [[[0], [1]], [[0, 2], [1, 3]], [[0, 3], [1, 2]], [[0, 4], [1, 5], [2, 6], [3, 7]]],
    ids=["one_stage_per_rank", "interleaved", "v_shape", "interleaved_4_ranks"],
)
def test_ranks_key_orders_merge_into_the_whole_models(stages_of_rank):
    """With `mapper=None` the file split follows the merged key order: the one-process order, also
    when a rank holds several stages (its state dict lists layers 0, 1, 4, 5)."""
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, trim_to_stage

    config = ReferenceModelConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=16, num_attention_heads=2
    )
    num_stages = sum(len(stages) for stages in stages_of_rank)
    per_stage = config.num_layers // num_stages
    with torch.device("meta"):
        whole = list(ReferenceForCausalLM(config).state_dict())
        orders = []
        for rank, stages in enumerate(stages_of_rank):
            order = []
            for index in stages:  # a rank's merged module lists its stages' keys stage by stage
                stage = ReferenceForCausalLM(config)
                layers = range(index * per_stage, (index + 1) * per_stage)
                trim_to_stage(stage, StageSpec(index, num_stages, rank, layers))
                order += list(stage.state_dict())
            orders += [order, order]  # and its data-parallel replica
    assert merge_key_orders(orders) == whole


def test_key_orders_keep_each_ranks_order_where_names_do_not_tell():
    first = ["wte.weight", "blocks.0.w", "blocks.1.w"]  # "wte" sorts after "blocks": rank order decides
    last = ["blocks.2.w", "blocks.10.w", "ln_f.weight", "head.weight"]
    assert merge_key_orders([first, last]) == first + last
