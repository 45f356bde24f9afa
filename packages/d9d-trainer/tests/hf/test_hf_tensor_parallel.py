"""Tensor parallelism of the Hugging Face backend from transformers' `base_model_tp_plan`, per
architecture it is offered for: three steps on TP 2 (real gloo processes) equal one process in every
loss, grad norm and final weight, the export loads in transformers with the trained logits; one
architecture on TP 2 x FSDP 2 (4 ranks), and LoRA on TP 2 with adapters PEFT loads. What it cannot
split exactly is refused before anything is built, in one line naming the key and the fix; what it
can split is accepted, per style (a table of configs: a dim tp splits that divides, one that does
not, and the dims it never splits), and two accepted configs whose other dims do not divide train
like one process."""

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, hf_logits, max_rel, save_tiny, train

from d9d.ckpt import safetensors_shapes
from d9d.mesh import MeshConfig
from d9d.mesh.testing import run_distributed
from d9d.trainer.hf import HFCausalLMConfig, HFCausalLMProvider, HFModelError
from d9d.trainer.hf.tensor_parallel import TENSOR_PARALLEL_ARCHITECTURES, tensor_parallel_problem

#: Measured (torch 2.15, transformers 5.24, CPU, SGD lr 0.5, no clipping): TP 2 and TP 2 x FSDP 2 are
#: within 3.2e-8 of one process in losses, 1.1e-7 in grad norms (relative), 1.2e-7 in weights
#: (absolute).
RUN_REL = 1e-5
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-tp-models")
    return {name: save_tiny(name, root / name) for name in sorted(TENSOR_PARALLEL_ARCHITECTURES)}


def _spread(run: dict[str, Any], one: dict[str, Any]) -> dict[str, float]:
    weights = max((run["weights"][k] - v).abs().max().item() for k, v in one["weights"].items())
    return {
        "loss": max_rel(run["losses"], one["losses"]),
        "grad_norm": max_rel(run["grad_norms"], one["grad_norms"]),
        "weights": weights,
    }


def _assert_equal_runs(run: dict[str, Any], one: dict[str, Any]) -> None:
    spread = _spread(run, one)
    assert run["keys"] == one["keys"]  # the same Hugging Face names on every layout
    assert spread["loss"] <= RUN_REL, spread
    assert spread["grad_norm"] <= RUN_REL, spread
    assert run["weights"].keys() == one["weights"].keys()
    for name, value in one["weights"].items():
        torch.testing.assert_close(run["weights"][name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("model_type", sorted(TENSOR_PARALLEL_ARCHITECTURES))
def test_tp2_trains_like_one_process_and_exports_transformers_loads(tmp_path, folders, model_type):
    folder = folders[model_type]
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    config = hf_job(folder, tmp_path / "runs", name="tp2", mesh={"tensor_parallel": 2})
    tp = run_distributed(train, 2, config, tmp_path / "export-tp2", timeout=120)[0]
    assert one["losses"][-1] < one["losses"][0]  # it trains
    # it is split: every projection of every layer holds half its rows (colwise) or columns (rowwise)
    shapes = {k: tuple(v.shape) for k, v in one["weights"].items()}
    projections = [k for k in shapes if k.endswith("_proj.weight") and ".layers." in k]
    assert projections and all(k in tp["split"] for k in projections), sorted(
        set(projections) - set(tp["split"])
    )
    for name in projections:
        ratios = [a / b for a, b in zip(tp["split"][name], shapes[name], strict=True)]
        assert sorted(ratios) == [0.5, 1.0], (name, tp["split"][name], shapes[name])
    _assert_equal_runs(tp, one)
    torch.testing.assert_close(tp["imported"], one["imported"], rtol=RTOL, atol=ATOL)
    assert safetensors_shapes(tmp_path / "export-tp2") == safetensors_shapes(folder)  # whole tensors
    exported = hf_logits(tmp_path / "export-tp2")
    torch.testing.assert_close(exported, tp["trained"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(exported, one["trained"], rtol=RTOL, atol=ATOL)


def test_tp2_by_fsdp2_on_four_ranks_trains_like_one_process(tmp_path, folders):
    folder = folders["llama"]
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    mesh = {"tensor_parallel": 2, "data_parallel_shard": 2}
    config = hf_job(folder, tmp_path / "runs", name="tp2fsdp2", mesh=mesh)
    run = run_distributed(train, 4, config, tmp_path / "export-4", timeout=180)[0]
    _assert_equal_runs(run, one)
    torch.testing.assert_close(hf_logits(tmp_path / "export-4"), one["trained"], rtol=RTOL, atol=ATOL)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
def test_lora_on_tp2_trains_like_one_process_and_its_adapters_load_in_peft(tmp_path, folders):
    folder = folders["qwen3"]
    lora = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": [r".*\.(q_proj|v_proj|down_proj)"]}}
    job = {"peft": lora, "export": {"lora": "both"}}
    one = train(hf_job(folder, tmp_path / "runs", name="one", **job), tmp_path / "export-one")
    config = hf_job(folder, tmp_path / "runs", name="tp2", mesh={"tensor_parallel": 2}, **job)
    tp = run_distributed(train, 2, config, tmp_path / "export-tp2", timeout=120)[0]
    _assert_equal_runs(tp, one)
    adapters = [k for k in tp["keys"] if ".lora_" in k]
    assert adapters and all(k.startswith("model.layers.") for k in adapters)
    with_adapters = hf_logits(folder, adapter=tmp_path / "export-tp2" / "adapter")
    torch.testing.assert_close(with_adapters, tp["trained"], rtol=RTOL, atol=ATOL)
    assert not torch.allclose(with_adapters, hf_logits(folder))  # the adapters trained


def test_what_tensor_parallelism_cannot_split_is_one_line_naming_the_key_and_the_fix(tmp_path):
    olmo2 = save_tiny("olmo2", tmp_path / "olmo2")
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(olmo2)))
    provider.check_mesh(MeshConfig(data_parallel_shard=2))  # FSDP is fine
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(tensor_parallel=2))
    (line,) = str(refused.value).splitlines()
    assert line.startswith("mesh.tensor_parallel=2: the Hugging Face backend")
    assert "'olmo2' is not verified" in line and "; set mesh.tensor_parallel: 1" in line

    import transformers

    llama = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=1)
    problem = tensor_parallel_problem(llama, 2, prefix="model", shapes={})
    assert (
        problem is not None and "num_key_value_heads=1 is not divisible by mesh.tensor_parallel=2" in problem
    )
    llama = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    shapes = {
        "model.layers.0.mlp.gate_proj.weight": (63, 32),
        "model.layers.0.mlp.down_proj.weight": (32, 63),
    }
    problem = tensor_parallel_problem(llama, 2, prefix="model", shapes=shapes)
    assert problem is not None and "gate_proj.weight has 63 rows, not divisible" in problem
    assert tensor_parallel_problem(llama, 2, prefix="model", shapes={}) is None
    no_plan = tensor_parallel_problem(transformers.GPT2Config(), 2, prefix="transformer", shapes={})
    assert no_plan is not None and "has no tensor-parallel plan" in no_plan


#: (model_type, config.json changes, tp, what the refusal names or None: accepted). Per splitting
#: style, a dim that divides tp is accepted and one that does not is refused naming it; the dims tp
#: does not split (the hidden size, the vocabulary, the heads of a gathered projection) never refuse.
_SPLITS = [
    ("llama", {}, 2, None),
    ("qwen3", {}, 2, None),  # its per-head q/k norms: replicated, nothing to divide
    ("phi3", {}, 2, None),
    # colwise cuts a weight's rows and rowwise its columns: the hidden size (q_proj's columns, o_proj's
    # and down_proj's rows) is never cut
    ("qwen3", {"hidden_size": 33, "head_dim": 8}, 2, None),
    ("mistral", {"hidden_size": 33, "head_dim": 8}, 2, None),
    # the embedding and the LM head are replicated: any vocabulary, tied or not
    ("llama", {"vocab_size": 97}, 2, None),
    ("llama", {"vocab_size": 97, "tie_word_embeddings": True}, 2, None),
    # colwise heads (q/k/v_proj): both head counts must divide
    ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}, 2, None),
    (
        "qwen3",
        {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8},
        2,
        "num_attention_heads=3 ",
    ),
    (
        "qwen3",
        {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8},
        2,
        "num_key_value_heads=3 ",
    ),
    ("qwen3", {"num_key_value_heads": 1}, 2, "num_key_value_heads=1 "),
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4}, 4, None),
    ("llama", {}, 4, "num_key_value_heads=2 "),
    # a gathered fused qkv (phi3's colwise_gather_output) does not split the heads: its rows must divide
    ("phi3", {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8}, 2, None),
    # the MLP's intermediate size: colwise gate/up rows and rowwise down_proj columns
    ("llama", {"intermediate_size": 66}, 2, None),
    ("llama", {"intermediate_size": 63}, 2, "mlp.down_proj.weight has 63 columns"),
    (
        "qwen3",
        {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4, "intermediate_size": 66},
        4,
        "mlp.down_proj.weight has 66 columns",
    ),
    # phi3's fused gate_up (gathered) has 2 x 63 rows; its rowwise_split_input down_proj has 63 columns
    ("phi3", {"intermediate_size": 63}, 2, "mlp.down_proj.weight has 63 columns"),
    # MoE: transformers' expert styles are not applied: refused whatever the sizes
    ("mixtral", {}, 2, "'moe_tp_experts', 'packed_colwise'"),
]


def _split_id(model_type: str, changes: dict[str, Any], tp: int, named: str | None) -> str:
    sizes = ",".join(f"{key}={value}" for key, value in changes.items())
    return f"{model_type}[{sizes}]-tp{tp}-{'accepted' if named is None else 'refused'}"


@pytest.mark.parametrize(
    ("model_type", "changes", "tp", "named"), _SPLITS, ids=[_split_id(*c) for c in _SPLITS]
)
def test_tensor_parallelism_accepts_every_config_it_can_split_and_refuses_naming_the_dim(
    tmp_path, model_type, changes, tp, named
):
    folder = save_tiny(model_type, tmp_path / "model", config=changes)
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(folder)))
    if named is None:
        provider.check_mesh(MeshConfig(tensor_parallel=tp))  # accepted: no refusal
        return
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(tensor_parallel=tp))
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"mesh.tensor_parallel={tp}: the Hugging Face backend") and named in line, line
    assert "; set mesh.tensor_parallel: 1" in line, line


@pytest.mark.parametrize(
    ("model_type", "changes"),
    [
        ("qwen3", {"hidden_size": 33, "head_dim": 8, "vocab_size": 97}),  # an odd hidden size and vocabulary
        ("phi3", {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8}),
    ],
    ids=["odd-hidden-and-vocab", "gathered-odd-heads"],
)
def test_configs_accepted_with_dims_tp_does_not_split_train_like_one_process(tmp_path, model_type, changes):
    folder = save_tiny(model_type, tmp_path / "model", config=changes)
    HFCausalLMProvider(HFCausalLMConfig(folder=str(folder))).check_mesh(MeshConfig(tensor_parallel=2))
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    config = hf_job(folder, tmp_path / "runs", name="tp2", mesh={"tensor_parallel": 2})
    tp = run_distributed(train, 2, config, tmp_path / "export-tp2", timeout=120)[0]
    assert tp["split"] and one["losses"][-1] < one["losses"][0]  # split, and it trains
    _assert_equal_runs(tp, one)
