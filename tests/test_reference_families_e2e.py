"""The reference model's new families under the parallelisms that touch what is new, through the
quickstart job: each run equals one process on the same data (3 SGD steps, fp32, no clipping) in
every step's loss and grad norm and in every final weight.

- q/k/v biases (Qwen2): a column-parallel projection's bias is sharded with its output dim (TP 2),
  and FSDP 2 shards and reduces it like any parameter.
- scaled RoPE (llama3, yarn) under context parallelism 2: each rank's tokens get their global
  positions (`ContextParallel.position_ids`), so the scaled tables are the one-process ones.
- Mixtral (experts in every layer, no q/k norm, renormalized top-2) under expert parallelism 2
  (with FSDP 2, as ep regroups the data-parallel ranks).

And the quickstart provider's `check_sequence_length`: a sliding window shorter than the dataset's
sequences is refused by the plan, before anything is built or written.

Ranks are forked from this process (`_quickstart.train`). REL is the quickstart e2e tests' 1e-5;
the measured spread is in each test's docstring.
"""

import json

import pytest
from _quickstart import (
    NO_CLIP,
    SGD,
    build_error,
    compare_runs,
    exported_weights,
    overrides,
    run_forked,
    train,
)

STEPS = 3
REL = 1e-5
QKV_BIAS = ["model.qkv_bias=true", "model.qk_norm=false"]
#: The quickstart's tiny model as a Mixtral: its intermediate_size (128) is the experts' width.
MIXTRAL = ["model.qk_norm=false", "model.moe={num_experts: 4, top_k: 2, moe_intermediate_size: 128}"]
#: Pretraining length 16 < the 32-token sequences: every band of the scaling is in use.
ROPE_SCALING = {
    "llama3": "{rope_type: llama3, factor: 4.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
    "original_max_position_embeddings: 16}",
    "yarn": "{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16}",
}


def _run(tmp_path, name: str, nproc: int, *extra: str):
    return train(nproc, overrides(tmp_path, name, STEPS, *SGD, *NO_CLIP, *extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)

    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def qkv_bias_reference(runs):
    reference = _run(runs, "qkv-bias-one", 1, *QKV_BIAS)
    biases = [name for name in reference.weights if name.endswith("_proj.bias")]
    assert len(biases) == 2 * 3  # q, k, v of both layers, no o_proj bias
    assert all(reference.weights[name].abs().max() > 0 for name in biases)  # zero at init: they trained
    return reference


@pytest.mark.parametrize(
    "mesh", [["mesh.tensor_parallel=2"], ["mesh.data_parallel_shard=2"]], ids=["tp2", "fsdp2"]
)
def test_qkv_biases_on_2_ranks_equal_one_process(runs, qkv_bias_reference, mesh):
    """Measured: loss 1.3e-8, grad norm 2.2e-7, weights 1.6e-6 relative (the k_proj biases: zero at
    init and small after 3 steps, so their relative spread is the largest)."""
    got = _run(runs, f"qkv-bias-{mesh[0]}", 2, *QKV_BIAS, *mesh)
    compare_runs(got, qkv_bias_reference, rel=REL)


@pytest.mark.parametrize("rope", list(ROPE_SCALING))
def test_scaled_rope_under_context_parallel_2_equals_one_process(runs, rope):
    """Measured: loss 3.2e-8, grad norm 1.9e-7, weights 1.1e-7 relative (either scaling)."""
    scaling = [f"model.rope_scaling={ROPE_SCALING[rope]}", "model.rope_theta=10000.0"]
    reference = _run(runs, f"{rope}-one", 1, *scaling)
    got = _run(runs, f"{rope}-cp2", 2, *scaling, "mesh.context_parallel=2")
    compare_runs(got, reference, rel=REL)


def test_mixtral_under_expert_parallel_2_equals_one_process_and_exports_as_mixtral(runs):
    """Measured: loss 1.3e-8, grad norm 8.2e-8, weights 7.8e-8 relative."""
    reference = _run(runs, "mixtral-one", 1, *MIXTRAL)
    export = runs / "mixtral-ep2-export"
    ep2 = ["mesh.data_parallel_shard=2", "mesh.expert_parallel=2", f"export.dir={export}"]
    got = _run(runs, "mixtral-ep2", 2, *MIXTRAL, *ep2)
    compare_runs(got, reference, rel=REL)
    assert json.loads((export / "config.json").read_text())["model_type"] == "mixtral"
    keys = set(exported_weights(export))
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= keys


def test_a_sliding_window_shorter_than_the_sequences_is_refused_before_anything_is_written(tmp_path):
    error = run_forked(build_error, overrides(tmp_path, "windowed", 2, "model.sliding_window=16"))
    assert error.startswith(
        "TrainingError: sequences of 32 tokens are longer than model.sliding_window=16: the reference model"
    ), error
    assert (
        "use sequences of at most 16 tokens (dataset.seq_len) or another backend (model.backend: hf" in error
    )
    assert "(the sequence length: 32 from providers.dataset" in error and "\n" not in error
    assert not (tmp_path / "windowed").exists()
