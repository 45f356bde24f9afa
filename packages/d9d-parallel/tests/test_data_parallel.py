import pytest
from _tiny_transformer import TinyConfig
from _train_compare import assert_same_run, reference_and_parallel_run

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.parallel import (
    apply_activation_checkpointing,
    parallelize_fsdp,
    parallelize_hsdp,
    parallelize_replicate,
)


def _hsdp(model, ctx):
    parallelize_hsdp(model, ctx.mesh("dense"), shard_axis="dp_shard", blocks=list(model.blocks))


def _fsdp(model, ctx):
    parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _replicate(model, ctx):
    parallelize_replicate(model, ctx.mesh("dense"), blocks=list(model.blocks))


def _fsdp_checkpointed(model, ctx):
    apply_activation_checkpointing(model.blocks)
    parallelize_fsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), reshard_after_forward=True)


def _compare(config, parallelize, **kwargs):
    results = run_distributed(reference_and_parallel_run, config.world_size, config, parallelize, **kwargs)
    reference, got = results[0]
    assert_same_run(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("ddp2", MeshConfig(data_parallel_replicate=2)),
        ("fsdp2", MeshConfig(data_parallel_shard=2)),
        ("fsdp4", MeshConfig(data_parallel_shard=4)),
        ("hsdp2x2", MeshConfig(data_parallel_replicate=2, data_parallel_shard=2)),
    ],
)
def test_hsdp_call_matches_one_process(name, config):
    """The one call of the Quickstart provider is DDP, FSDP or HSDP depending on the mesh."""
    _compare(config, _hsdp)


def test_replicate_ddp2_matches_one_process():
    _compare(MeshConfig(data_parallel_replicate=2), _replicate)


def test_fsdp_flattens_hsdp_axes_4_ranks():
    _compare(MeshConfig(data_parallel_replicate=2, data_parallel_shard=2), _fsdp)


def test_fsdp2_gradient_accumulation_sums_microbatches():
    _compare(MeshConfig(data_parallel_shard=2), _fsdp, microbatches=2)


def test_fsdp2_activation_checkpointing_keeps_numbers():
    _compare(MeshConfig(data_parallel_shard=2), _fsdp_checkpointed)


def _hsdp_mean(model, ctx):
    parallelize_hsdp(model, ctx.mesh("dense"), gradient_reduction="mean")


def test_hsdp2x2_mean_reduction_with_rank_local_loss():
    """The opt-in "mean" contract: average over dp, each rank divides by its own tokens."""
    _compare(MeshConfig(data_parallel_replicate=2, data_parallel_shard=2), _hsdp_mean, loss_scope="local")


def _ddp_mean(model, ctx):
    parallelize_replicate(model, ctx.mesh("dense"), gradient_reduction="mean")


def test_ddp2_mean_reduction_with_rank_local_loss():
    _compare(MeshConfig(data_parallel_replicate=2), _ddp_mean, loss_scope="local")


def test_hsdp2x2_on_a_meta_model_then_loaded_matches_one_process():
    """Build on meta, parallelize, materialize, load full weights: no rank ever holds the full model."""
    _compare(MeshConfig(data_parallel_replicate=2, data_parallel_shard=2), _hsdp, meta_init=True)


def test_fsdp4_with_uneven_shards_matches_one_process():
    """Sizes that 4 does not divide (vocab 62, hidden 66, dim 36): FSDP pads, the numbers must not care."""
    cfg = TinyConfig(vocab_size=62, dim=36, n_heads=3, hidden=66)
    _compare(MeshConfig(data_parallel_shard=4), _fsdp, cfg=cfg)


def _hsdp_keep_gathered(model, ctx):
    parallelize_hsdp(model, ctx.mesh("dense"), blocks=list(model.blocks), reshard_after_forward=False)


def test_hsdp2x2_without_reshard_after_forward_matches_one_process():
    _compare(MeshConfig(data_parallel_replicate=2, data_parallel_shard=2), _hsdp_keep_gathered)
