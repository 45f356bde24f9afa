"""Context parallelism of the Hugging Face backend (d9d's context-parallel attention registered as a
transformers attention implementation): three steps on CP 2, and on CP 2 × FSDP 2, equal one process
in every loss, grad norm and final weight, for the architectures it is offered for; what it cannot
split exactly is refused before anything is built, in one line naming the key and the fix."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, hf_logits, save_tiny, train
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


def test_what_context_parallelism_cannot_split_is_one_line_naming_the_key_and_the_fix(tmp_path):
    gemma2 = save_tiny("gemma2", tmp_path / "gemma2")  # sliding windows, soft-capped logits: not offered
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(gemma2)))
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(context_parallel=2))
    (line,) = str(refused.value).splitlines()
    assert line.startswith("mesh.context_parallel=2: the Hugging Face backend")
    assert "sliding window" in line and "soft-caps the logits (attn_logit_softcapping=" in line
    assert line.endswith("set mesh.context_parallel: 1")  # gemma2: no reference path to name
    mistral = save_tiny("mistral", tmp_path / "mistral", config={"sliding_window": 8})  # the reference has it
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(mistral)))
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(context_parallel=2))
    (line,) = str(refused.value).splitlines()
    assert "sliding window (sliding_window=8)" in line
    assert line.endswith("set mesh.context_parallel: 1, or train it with the reference model, which splits its "
                         "sequences (model.backend: reference, d9d.trainer:HFModelProvider)")  # fmt: skip
    import transformers

    from d9d.trainer.hf.context_parallel import context_parallel_problem

    windowed = transformers.Qwen2Config(use_sliding_window=True, sliding_window=8)
    problem = context_parallel_problem(transformers.Qwen2ForCausalLM, windowed)
    assert problem is not None and "sliding window" in problem
    plain = context_parallel_problem(transformers.Olmo2ForCausalLM, transformers.Olmo2Config())
    assert plain is not None and "model_type 'olmo2' is not verified" in plain


def _packed_forward_error(folder: Path) -> str:
    """On a rank of a cp 2 mesh: the error of a forward of packed rows (document ids)."""
    from _tiny_hf import load_hf, probe_batch

    from d9d.mesh import DistributedContext
    from d9d.trainer.hf import HFCausalLM
    from d9d.trainer.hf.context_parallel import apply_context_parallel

    with DistributedContext.from_env(MeshConfig(context_parallel=2), device="cpu") as ctx:
        hf = load_hf(folder)
        model = HFCausalLM(hf)
        apply_context_parallel(model, hf, ctx.mesh("dense"))
        ids, positions = probe_batch()
        documents = (positions == 0).cumsum(-1) - 1
        try:
            model(ids[:, :8], position_ids=positions[:, :8], document_ids=documents[:, :8])
        except HFModelError as exc:
            return str(exc)
    return "no error"


def test_packed_documents_under_context_parallelism_are_refused_not_trained_across(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")
    for error in run_distributed(_packed_forward_error, 2, folder, timeout=120):
        assert "packs documents (document_ids)" in error and "mesh.context_parallel: 1" in error, error
