"""`parallelize_decoder` and its unit rule `decoder_units`: the exact FSDP units of an untied model, a
tied one and pipeline stages, and FSDP 2 training equal to one process."""

import pytest
import torch
from _tiny_transformer import TinyConfig, TinyTransformer
from _train_compare import assert_same_run, reference_and_parallel_run
from torch import nn
from torch.distributed.fsdp import FSDPModule

from d9d.mesh import DistributedContext, MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    ActivationCheckpointingConfig,
    CompileConfig,
    ShardUnit,
    decoder_units,
    parallelize_decoder,
)

#: What a pipeline stage holds of the tiny model: (embedding, final norm and head).
STAGES = {"whole": (True, True), "first": (True, False), "middle": (False, False), "last": (False, True)}

B0, B1 = "blocks.0", "blocks.1"


def _model(tied: bool = False, stage: str = "whole", device: str = "meta") -> TinyTransformer:
    """The tiny decoder, trimmed to what `stage` holds (a tied last stage keeps the table's owner)."""
    with torch.device(device):
        model = TinyTransformer(TinyConfig(tie_embeddings=tied))
    embeds, ends = STAGES[stage]
    if not embeds and not (tied and ends):
        model.embed = None
    if not ends:
        model.norm = model.lm_head = None
    return model


def _parts(model: TinyTransformer) -> dict[str, nn.Module | None]:
    return {"embedding": model.embed, "final_norm": model.norm, "head": model.lm_head}


def _names(model: nn.Module, units: list[ShardUnit]) -> list[str | list[str]]:
    path = {id(m): name for name, m in model.named_modules()}
    return [path[id(u)] if isinstance(u, nn.Module) else [path[id(m)] for m in u] for u in units]


#: (tied, stage) → the units in the order `parallelize_hsdp` shards them (the last keeps its weights
#: gathered into backward).
EXPECTED = {
    (False, "whole"): ["embed", B0, B1, ["norm", "lm_head"]],
    (True, "whole"): [B0, B1, ["norm"], ["embed", "lm_head"]],
    (False, "first"): ["embed", B0, B1],
    (True, "first"): ["embed", B0, B1],  # the head is on the last stage: nothing to tie here
    (False, "middle"): [B0, B1],
    (True, "middle"): [B0, B1],
    (False, "last"): [B0, B1, ["norm", "lm_head"]],
    (True, "last"): [B0, B1, ["norm"], ["embed", "lm_head"]],
}


@pytest.mark.parametrize(("tied", "stage"), list(EXPECTED))
def test_units_of_a_decoder_and_of_its_pipeline_stages(tied, stage):
    model = _model(tied, stage)
    units = decoder_units(list(model.blocks), **_parts(model))
    assert _names(model, units) == EXPECTED[tied, stage]


def test_several_embedding_modules_are_one_unit_and_tie_with_the_head():
    model = _model()
    model.pos = nn.Embedding(8, 32, device="meta")
    embedding = [model.embed, model.pos]
    units = decoder_units(list(model.blocks), embedding=embedding, final_norm=model.norm, head=model.lm_head)
    assert _names(model, units) == [["embed", "pos"], B0, B1, ["norm", "lm_head"]]
    model.lm_head.weight = model.embed.weight
    units = decoder_units(list(model.blocks), embedding=embedding, final_norm=model.norm, head=model.lm_head)
    assert _names(model, units) == [B0, B1, ["norm"], ["embed", "pos", "lm_head"]]


def _applied_units(cases: list[tuple[bool, str]]) -> list[dict[frozenset[str], bool]]:
    """In a forked rank: per case, each FSDP2 unit that `parallelize_decoder` made on FSDP 2, as its
    parameter names → whether it reshards after forward (the root holds none of its own)."""
    found = []
    with DistributedContext.from_env(MeshConfig(data_parallel_shard=2)) as ctx:
        for tied, stage in cases:
            model = _model(tied, stage)
            parallelize_decoder(model, ctx.mesh("dense"), blocks=list(model.blocks), **_parts(model))
            names = {id(p): n for n, p in model.named_parameters()}
            groups: dict[frozenset[str], bool] = {}
            for module in model.modules():
                group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
                if group is not None:
                    key = frozenset(names[id(p.sharded_param)] for p in group.fsdp_params)
                    groups[key] = group._reshard_after_forward
            found.append(groups)
    return found


def _expected_groups(tied: bool, stage: str) -> dict[frozenset[str], bool]:
    model = _model(tied, stage)
    params = {n for n, _ in model.named_parameters()}
    units = EXPECTED[tied, stage]
    groups = {}
    for index, unit in enumerate(units):
        prefixes = [unit] if isinstance(unit, str) else unit
        key = frozenset(n for n in params if any(n.startswith(f"{p}.") for p in prefixes))
        groups[key] = index < len(units) - 1  # the last unit stays gathered into backward
    return groups


def test_parallelize_decoder_shards_exactly_these_units_fsdp2():
    """On 2 ranks: the units of every case above (nothing left in the root); the last unit, the tied
    table's when the head is tied, is the one that stays gathered after forward."""
    cases = list(EXPECTED)
    found = run_distributed(_applied_units, 2, cases)[0]
    for case, groups in zip(cases, found, strict=True):
        assert groups == _expected_groups(*case), case


def _decoder(model: TinyTransformer, ctx: DistributedContext) -> None:
    parallelize_decoder(
        model,
        ctx.mesh("dense"),
        blocks=list(model.blocks),
        embedding=model.embed,
        final_norm=model.norm,
        head=model.lm_head,
        activation_checkpointing=ActivationCheckpointingConfig(mode="full"),
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_matches_one_process(tied):
    """Losses, grad norms and weights after 3 AdamW steps (activation checkpointing on every block)."""
    config = MeshConfig(data_parallel_shard=2)
    cfg = TinyConfig(tie_embeddings=tied)
    reference, got = run_distributed(reference_and_parallel_run, 2, config, _decoder, cfg=cfg)[0]
    assert_same_run(got, reference, rtol=1e-4, atol=1e-5)


def test_one_process_checkpoints_and_compiles_the_blocks_only(monkeypatch):
    """With no mesh nothing is sharded, but the blocks are checkpointed and handed to `compile_blocks`
    (recorded here: its own tests compile), in place; the embedding and the head are neither."""
    import d9d.parallel.decoder as decoder_module

    compiled = []
    monkeypatch.setattr(
        decoder_module, "compile_blocks", lambda blocks, config: compiled.append((blocks, config))
    )
    model = _model(device="cpu")
    keys = list(model.state_dict())
    compile_config = CompileConfig(enabled=True)
    parallelize_decoder(
        model,
        None,
        blocks=list(model.blocks),
        **_parts(model),
        activation_checkpointing=ActivationCheckpointingConfig(mode="selective", every=2),
        compile=compile_config,
    )
    assert [getattr(b, "_d9d_activation_checkpointed", False) for b in model.blocks] == [True, False]
    assert compiled == [(list(model.blocks), compile_config)]
    for module in (model, model.embed, model.norm, model.lm_head):
        assert not isinstance(module, FSDPModule)
        assert not getattr(module, "_d9d_activation_checkpointed", False)
    assert list(model.state_dict()) == keys


def test_defaults_neither_checkpoint_nor_compile():
    model = _model(device="cpu")
    parallelize_decoder(model, None, blocks=list(model.blocks), **_parts(model))
    assert not any(
        getattr(b, "_d9d_activation_checkpointed", False) or getattr(b, "_d9d_compiled", False)
        for b in model.blocks
    )
