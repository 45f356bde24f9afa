"""The Hugging Face backend's parts in one process: what it refuses and with which words, how folder
keys map onto the model (tied tensors, old rotary buffers), the packed forward, the init hook."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import ARCHITECTURES, MORE_ARCHITECTURES, VOCAB, hf_job, load_hf, save_tiny

from d9d.mesh import DistributedContext, MeshConfig
from d9d.parallel import AttentionKernel
from d9d.trainer import TrainingError, load_job_config, materialize_and_initialize, resolve_job
from d9d.trainer.hf import HFCausalLM, HFCausalLMConfig, HFCausalLMProvider, HFModelError
from d9d.trainer.planning.job_plan import check_model_mesh
from d9d.trainer.providers import InitializeModelStageContext


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("gemma2", tmp_path_factory.mktemp("hf") / "gemma2")  # tied, no sdpa


def _build(folder: Path, kernel: str = "auto", **options: object) -> HFCausalLM:
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=folder.name, **options))  # type: ignore[arg-type]
    order = () if kernel in ("auto", "flex") else (kernel,)
    context = InitializeModelStageContext(
        context=DistributedContext.from_env(MeshConfig()), base_dir=folder.parent,
        attention=AttentionKernel(kernel, "trainer.attention.backend", order, kernel),
    )  # fmt: skip
    with torch.device("meta"):
        model = provider.initialize_model_stage(context).model
    assert isinstance(model, HFCausalLM)
    return model


def _copy(folder: Path, target: Path) -> Path:
    target.mkdir()
    for file in folder.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize(
    ("degree", "words"),
    [
        (
            "pipeline_parallel",
            ["does not cut", "stages", "mesh.pipeline_parallel: 1", "model.backend: reference"],
        ),
        ("expert_parallel", ["expert parallelism", "mixtral and qwen3_moe", "mesh.expert_parallel: 1"]),
    ],
)
def test_the_mesh_degrees_it_lacks_are_refused_before_anything_is_built(tmp_path, llama, degree, words):
    mesh = {degree: 2} if degree != "expert_parallel" else {"data_parallel_shard": 2, "expert_parallel": 2}
    job = resolve_job(load_job_config(hf_job(llama, tmp_path, mesh=mesh)))
    with pytest.raises(TrainingError) as caught:
        check_model_mesh(job)  # the plan's and the trainer's check, and d9d plan's
    message = str(caught.value)
    assert message.startswith(
        f"mesh.{degree}=2: the Hugging Face backend (d9d.trainer.hf:HFCausalLMProvider)"
    )
    assert all(word in message for word in words), message
    assert "\n" not in message
    check_model_mesh(resolve_job(load_job_config(hf_job(llama, tmp_path, mesh={"data_parallel_shard": 2}))))
    check_model_mesh(resolve_job(load_job_config(hf_job(llama, tmp_path, mesh={"context_parallel": 2}))))


def test_folder_problems_are_one_line_naming_the_file_and_the_fix(tmp_path, llama):
    with pytest.raises(HFModelError, match=r"model.folder: .*missing is not a directory; point model.folder"):
        _build(tmp_path / "missing")
    (tmp_path / "no-config").mkdir()
    with pytest.raises(HFModelError, match=r"no-config has no config.json; point model.folder"):
        _build(tmp_path / "no-config")
    remote = _copy(llama, tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    with pytest.raises(HFModelError, match=r"remote/config.json asks for the model's own modeling code"):
        _build(remote)
    unknown = _copy(llama, tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-llm"}))
    with pytest.raises(
        HFModelError, match=r"transformers .* cannot read it \(model_type 'no-such-llm'.*upgrade"
    ):
        _build(unknown)
    encoder = tmp_path / "t5"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(HFModelError, match=r"model_type 't5' has no causal LM in transformers"):
        _build(encoder)


def test_the_folder_weights_are_checked_against_config_json_from_the_headers(tmp_path, llama):
    extra = _copy(llama, tmp_path / "extra")
    tensors = load_file(extra / "model.safetensors")
    save_file({**tensors, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, extra / "model.safetensors")
    with pytest.raises(HFModelError, match=r"holds 1 tensors that LlamaForCausalLM as .* does not have"):
        _build(extra)
    missing = _copy(llama, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if "layers.1." not in k}, missing / "model.safetensors")
    with pytest.raises(HFModelError, match=r"lacks \d+ tensors of LlamaForCausalLM .*model.layers.1"):
        _build(missing)
    old = _copy(llama, tmp_path / "old-rotary")  # an old export that saved the rotary frequencies
    save_file(
        {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, old / "model.safetensors"
    )
    _build(old)


def test_attention_auto_takes_sdpa_where_the_architecture_has_it(llama, gemma2):
    assert _build(llama).config._attn_implementation == "sdpa"
    assert _build(gemma2).config._attn_implementation == "eager"
    with pytest.raises(
        HFModelError, match=r"model.attention: sdpa, but Gemma2ForCausalLM has no sdpa .*eager"
    ):
        _build(gemma2, attention="sdpa")


def test_the_trainers_attention_kernel_maps_to_transformers_implementation(llama, gemma2):
    # trainer.attention.backend: flex is transformers' flex_attention; an SDPA kernel its sdpa (the
    # trainer restricts SDPA to the kernel around each step); what does not map is one line
    assert _build(llama, "flex").config._attn_implementation == "flex_attention"
    assert _build(llama, "math").config._attn_implementation == "sdpa"
    assert _build(llama, "flash", attention="sdpa").config._attn_implementation == "sdpa"
    with pytest.raises(HFModelError, match=r"^model.attention: eager, but trainer.attention.backend: math runs "
                       r"through transformers' sdpa attention; set model.attention: auto"):  # fmt: skip
        _build(llama, "math", attention="eager")
    with pytest.raises(
        HFModelError, match=r"trainer.attention.backend: flash, but Gemma2ForCausalLM has no sdpa"
    ):
        _build(gemma2, "flash")


def test_a_tied_model_reads_its_table_once_and_ignores_a_stored_head_copy(tmp_path, gemma2):
    model = _build(gemma2)
    assert model.layout.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert model.get_input_embeddings().num_embeddings == VOCAB  # the trainer's vocabulary check
    both = _copy(gemma2, tmp_path / "both")
    tensors = load_file(both / "model.safetensors")
    assert "lm_head.weight" not in tensors  # transformers stores the tied table once
    save_file(
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
        both / "model.safetensors",
    )
    _build(both)


def test_document_ids_need_the_position_ids_that_carry_their_boundaries(llama):
    model = _build(llama)
    materialize_and_initialize(model, torch.device("cpu"), seed=0)
    ids = torch.randint(3, VOCAB, (1, 8))
    with pytest.raises(HFModelError, match="document_ids but no position_ids"):
        model(ids, document_ids=torch.zeros(1, 8, dtype=torch.long))


def test_initialization_computes_every_buffer_no_checkpoint_holds(llama):
    model = _build(llama)
    materialize_and_initialize(model, torch.device("cpu"), seed=0)
    reference = load_hf(llama)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)
    model = _build(llama)
    model.model.norm.register_buffer("scale", torch.empty(1, device="meta"), persistent=False)
    with pytest.raises(HFModelError, match=r"does not compute the buffer model.norm.scale"):
        materialize_and_initialize(model, torch.device("cpu"), seed=0)


def test_every_architecture_builds_under_hugging_face_names(tmp_path):
    for name in ARCHITECTURES:
        folder = save_tiny(name, tmp_path / name)
        model = _build(folder)
        assert list(model.state_dict()) == list(load_hf(folder).state_dict()), name
        assert len(model.decoder_layers()) == 2, name
        assert model.flops_per_token(16) > 0


def test_checkpointing_and_compile_act_on_each_decoder_layer_and_keep_the_names(llama, monkeypatch):
    import d9d.parallel.decoder as decoder_module
    from d9d.parallel import ActivationCheckpointingConfig, CompileConfig
    from d9d.trainer.providers import ParallelizeModelStageContext

    compiled = []  # torch.compile itself costs ~50 s cold here; what it is given is the backend's part
    monkeypatch.setattr(
        decoder_module, "compile_blocks", lambda blocks, config: compiled.append((blocks, config))
    )
    model = _build(llama)
    names = list(model.state_dict())
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(llama)))
    context = ParallelizeModelStageContext(
        context=DistributedContext.from_env(MeshConfig()),
        model=model,
        activation_checkpointing=ActivationCheckpointingConfig(mode="full"),
        compile=CompileConfig(enabled=True),
    )
    provider.parallelize_model_stage(context)
    layers = model.decoder_layers()
    assert [type(layer).__name__ for layer in layers] == ["LlamaDecoderLayer"] * 2
    assert all(layer._d9d_activation_checkpointed for layer in layers)
    assert compiled == [(layers, context.compile)]
    assert list(model.state_dict()) == names


@pytest.mark.parametrize("model_type", ["deepseek_v3", "mixtral"])
def test_moe_folders_build_from_either_expert_layout_and_tp_refuses_what_it_cannot_split(
    tmp_path, model_type
):
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config({**ARCHITECTURES, **MORE_ARCHITECTURES}[model_type]())
    hf.save_pretrained(tmp_path / "per-expert")  # transformers' default: one weight per expert
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)  # the tensors as held in memory
    per_expert = set(load_file(tmp_path / "per-expert" / "model.safetensors"))
    assert any(".experts.0." in k for k in per_expert) and not any("gate_up_proj" in k for k in per_expert)
    for layout in ("per-expert", "fused"):
        model = _build(tmp_path / layout)
        assert list(model.state_dict()) == list(hf.state_dict()), layout
    provider = HFCausalLMProvider(HFCausalLMConfig(folder=str(tmp_path / "per-expert")))
    with pytest.raises(HFModelError) as refused:
        provider.check_mesh(MeshConfig(tensor_parallel=2))
    (line,) = str(refused.value).splitlines()
    assert (
        line.startswith("mesh.tensor_parallel=2: the Hugging Face backend")
        and "; set mesh.tensor_parallel: 1" in line
    )


#: google/gemma-2-9b's config.json, written out from its public file (not downloaded).
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 256000,
}


def test_gemma_2_9b_config_builds_on_meta_with_its_shapes_and_the_mesh_verdicts(tmp_path):
    from transformers import AutoModelForCausalLM

    from d9d.trainer.hf import HFCausalLM
    from d9d.trainer.hf.folder import read_folder
    from d9d.trainer.hf.provider import context_parallel_refusal
    from d9d.trainer.hf.tensor_parallel import tensor_parallel_problem
    from d9d.trainer.models import HFConversionError, from_hf_config

    with pytest.raises(HFConversionError) as refused:  # the reference path refuses it in one line
        from_hf_config(GEMMA_2_9B)
    (line,) = str(refused.value).splitlines()
    assert "model_type 'gemma2'" in line and "model.backend: hf" in line
    folder = tmp_path / "gemma-2-9b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA_2_9B))
    read = read_folder(folder)
    assert read.model_class.__name__ == "Gemma2ForCausalLM"
    with torch.device("meta"):
        model = HFCausalLM(AutoModelForCausalLM.from_config(read.config, dtype=torch.float32))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    hidden, heads, kv_heads, head_dim, ffn = 3584, 16, 8, 256, 14336
    assert shapes["model.embed_tokens.weight"] == (256000, hidden)
    assert model.layout.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    layer = "model.layers.41."
    assert shapes[layer + "self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    assert shapes[layer + "self_attn.k_proj.weight"] == (kv_heads * head_dim, hidden)
    assert shapes[layer + "self_attn.o_proj.weight"] == (hidden, heads * head_dim)
    assert shapes[layer + "mlp.gate_proj.weight"] == (ffn, hidden)
    assert shapes[layer + "mlp.down_proj.weight"] == (hidden, ffn)
    assert len(model.decoder_layers()) == 42 and "model.layers.42.mlp.up_proj.weight" not in shapes
    params = sum(t.numel() for t in model.parameters())
    assert 9.2e9 < params < 9.3e9  # "9B": 9.24e9 with the tied embedding counted once
    stored = {k: v for k, v in shapes.items() if k not in model.layout.tied}
    problem = tensor_parallel_problem(read.config, 2, prefix=model.base_model_path, shapes=stored)
    assert problem is not None and "'gemma2' is not verified" in problem
    assert context_parallel_refusal(read, 2) is None  # its windows and soft-capped logits run under cp
