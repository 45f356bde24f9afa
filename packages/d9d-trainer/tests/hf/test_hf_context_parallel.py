"""Context parallelism of the Hugging Face backend (d9d's context-parallel attention registered as a
transformers attention implementation): three steps on CP 2, CP 4, CP 2 × FSDP 2 and CP 2 × TP 2 equal one process
in every loss, grad norm and final weight, for the architectures it is offered for, on single-document
and packed rows, with and without sliding windows (Mistral, Qwen2, Gemma 2/3); what it cannot split
exactly is refused before anything is built, in one line naming the key and the fix."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, hf_logits, max_rel, save_tiny, train
from test_hf_tensor_parallel import ATOL, RTOL, _assert_equal_runs

from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.trainer.hf import HFCausalLMConfig, HFCausalLMProvider, HFModelError

PLAIN = {
    "providers": {"model": "d9d.trainer.hf:HFCausalLMProvider", "dataset": "_tiny_hf:PlainTokensProvider"}
}


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_cp2_trains_like_one_process(tmp_path, model_type):
    folder = save_tiny(model_type, tmp_path / model_type)
    one = train(hf_job(folder, tmp_path / "runs", name="one", **PLAIN), tmp_path / "export-one")
    config = hf_job(folder, tmp_path / "runs", name="cp2", mesh={"context_parallel": 2}, **PLAIN)
    cp = run_distributed(train, 2, config, tmp_path / "export-cp2", timeout=120)[0]
    assert one["losses"][-1] < one["losses"][0]
    _assert_equal_runs(cp, one)
    torch.testing.assert_close(hf_logits(tmp_path / "export-cp2"), one["trained"], rtol=RTOL, atol=ATOL)


def test_cp2_by_fsdp2_on_four_ranks_trains_like_one_process(tmp_path):
    folder = save_tiny("qwen3", tmp_path / "qwen3")
    one = train(hf_job(folder, tmp_path / "runs", name="one", **PLAIN), tmp_path / "export-one")
    mesh = {"context_parallel": 2, "data_parallel_shard": 2}
    run = run_distributed(train, 4, hf_job(folder, tmp_path / "runs", name="cp2fsdp2", mesh=mesh, **PLAIN),
                          tmp_path / "export-4", timeout=180)[0]  # fmt: skip
    _assert_equal_runs(run, one)


#: Windowed models (a window of 5 tokens, shorter than the rows' documents of 10 and 6): every layer
#: (mistral), a local layer then a global one (gemma3_text, qwen2 with use_sliding_window, gemma2,
#: whose attention logits are soft-capped: at 1.0, with weights initialized 10x wider than the
#: default, so the cap changes the logits by 0.08 where at the defaults it changes them by 1e-7).
WINDOWED = {
    "mistral": {"sliding_window": 5},
    "gemma3_text": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["full_attention", "sliding_attention"]},
    "gemma2": {"sliding_window": 5, "attn_logit_softcapping": 1.0, "initializer_range": 0.2},
}  # fmt: skip


def _assert_within_1e5(run: dict, one: dict) -> None:
    """Losses and grad norms within 1e-5 (relative) of one process, and every weight tensor within
    1e-5 in norm (||a − b|| / ||b||). Measured (3 SGD steps): losses <= 7.4e-8, grad norms <= 1.4e-6,
    weights <= 3.2e-6 (gemma3_text's tied embedding; llama 1.4e-7); a layer that ignores its window,
    its soft cap or the documents fails it."""
    assert run["keys"] == one["keys"]
    assert (
        max_rel(run["losses"], one["losses"]) <= 1e-5
        and max_rel(run["grad_norms"], one["grad_norms"]) <= 1e-5
    )
    for name, value in one["weights"].items():
        off = float((run["weights"][name] - value).double().norm() / value.double().norm())
        assert off <= 1e-5, (name, off)


@pytest.mark.parametrize("model_type", ["llama", *WINDOWED])
def test_cp2_on_packed_rows_trains_like_one_process(tmp_path, model_type):
    """Rows of two packed documents (10 and 6 tokens: both cross chunk boundaries at cp 2), attended
    within each document and, for the windowed models, within the window, on whichever rank the keys are."""
    folder = save_tiny(model_type, tmp_path / model_type, config=WINDOWED.get(model_type))
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    cp = run_distributed(train, 2, hf_job(folder, tmp_path / "runs", name="cp2", mesh={"context_parallel": 2}),
                         tmp_path / "export-cp2", timeout=120)[0]  # fmt: skip
    assert one["losses"][-1] < one["losses"][0]
    _assert_within_1e5(cp, one)


def test_a_windowed_model_on_single_document_rows_trains_like_one_process(tmp_path):
    folder = save_tiny("gemma3_text", tmp_path / "gemma3", config=WINDOWED["gemma3_text"])
    one = train(hf_job(folder, tmp_path / "runs", name="one", **PLAIN), tmp_path / "export-one")
    job = hf_job(folder, tmp_path / "runs", name="cp2", mesh={"context_parallel": 2}, **PLAIN)
    _assert_within_1e5(run_distributed(train, 2, job, tmp_path / "export-cp2", timeout=120)[0], one)


#: Packed, windowed rows on the bigger meshes: (model, its config, mesh). At cp 4 the 16-token rows are
#: 8 chunks of 2, so the second document starts exactly at a chunk boundary (token 10).
BIGGER = {
    "cp4-mistral": ("mistral", WINDOWED["mistral"], {"context_parallel": 4}),
    "cp2-fsdp2-gemma3": ("gemma3_text", WINDOWED["gemma3_text"], {"context_parallel": 2, "data_parallel_shard": 2}),
    "cp2-tp2-qwen2": ("qwen2", WINDOWED["qwen2"], {"context_parallel": 2, "tensor_parallel": 2}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BIGGER))
def test_packed_windowed_rows_on_cp4_and_cp2_with_fsdp2_or_tp2_train_like_one_process(tmp_path, name):
    model_type, config, mesh = BIGGER[name]
    folder = save_tiny(model_type, tmp_path / model_type, config=config)
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    job = hf_job(folder, tmp_path / "runs", name=name, mesh=mesh)
    _assert_within_1e5(run_distributed(train, 4, job, tmp_path / f"export-{name}", timeout=180)[0], one)


def test_the_batch_mask_holds_the_windows_transformers_gives_the_layers():
    import transformers

    from d9d.trainer.hf.context_parallel import layer_windows

    assert layer_windows(transformers.LlamaConfig()) == (None,)
    assert layer_windows(transformers.MistralConfig(sliding_window=7)) == (7,)
    assert layer_windows(transformers.MistralConfig(sliding_window=None)) == (None,)
    assert layer_windows(transformers.Qwen2Config(use_sliding_window=False, sliding_window=7)) == (None,)
    qwen2 = transformers.Qwen2Config(
        use_sliding_window=True, sliding_window=7, num_hidden_layers=4, max_window_layers=2
    )
    assert layer_windows(qwen2) == (None, 7)
    gemma3 = transformers.Gemma3TextConfig(
        sliding_window=9, num_hidden_layers=2, layer_types=["sliding_attention"] * 2
    )
    assert layer_windows(gemma3) == (9,)


def test_what_context_parallelism_cannot_split_is_one_line_naming_the_key_and_the_fix(tmp_path):
    llama = save_tiny("llama", tmp_path / "llama", config={"attention_dropout": 0.1})  # dropout: not offered
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(llama)))
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(context_parallel=2))
    (line,) = str(refused.value).splitlines()
    assert line.startswith("mesh.context_parallel=2: the Hugging Face backend")
    assert "has dropout (attention_dropout > 0; set it to 0)" in line
    assert line.endswith(
        "(model.backend: reference, d9d.trainer:HFModelProvider)"
    )  # llama: the reference has it
    import transformers

    from d9d.trainer.hf.context_parallel import context_parallel_problem

    for model_class, config in (
        (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(use_sliding_window=True, sliding_window=8)),
        (transformers.Gemma2ForCausalLM, transformers.Gemma2Config()),  # windows and soft-capped logits
    ):
        assert context_parallel_problem(model_class, config) is None  # computed now
    plain = context_parallel_problem(transformers.Olmo2ForCausalLM, transformers.Olmo2Config())
    assert plain is not None and "model_type 'olmo2' is not verified" in plain
