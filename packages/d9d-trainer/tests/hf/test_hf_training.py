"""The Hugging Face backend end to end, per architecture: the import gives transformers' logits, three
steps on one process equal FSDP 2 with activation checkpointing (real gloo processes) in losses, grad
norms and weights, and both exports load in transformers with the trained logits; a LoRA run's
adapters load in PEFT likewise."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import ARCHITECTURES, MORE_ARCHITECTURES, hf_job, hf_logits, load_hf, max_rel, save_tiny, train

from d9d.ckpt import safetensors_shapes
from d9d.mesh.testing import run_distributed

#: Measured (torch 2.15, transformers 5.24, CPU): import and export logits are identical to
#: transformers' (0 in float32; the merged LoRA export 1e-7); FSDP 2 with activation checkpointing is
#: within 6e-8 of one process in losses, 6e-7 in grad norms (relative), 1.3e-7 in weights (absolute);
#: compiled per decoder layer, llama is within 0 of eager in losses and grad norms, 1.5e-8 in weights.
LOGITS_ATOL = 1e-6
RUN_REL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-models")
    return {name: save_tiny(name, root / name) for name in ARCHITECTURES}


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_import_train_fsdp2_and_export_match_transformers(tmp_path, folders, model_type):
    folder = folders[model_type]
    expected = hf_logits(folder)
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    fsdp = run_distributed(
        train,
        2,
        hf_job(
            folder,
            tmp_path / "runs",
            name="fsdp2",
            mesh={"data_parallel_shard": 2},
            trainer={"activation_checkpointing": {"mode": "full"}},  # recomputes the same numbers
        ),
        tmp_path / "export-fsdp2",
        timeout=120,
    )[0]
    hf_keys = list(load_hf(folder).state_dict())
    assert one["keys"] == hf_keys  # checkpoint and export keys are Hugging Face's names
    for run in (one, fsdp):
        torch.testing.assert_close(run["imported"], expected, rtol=0, atol=LOGITS_ATOL)
    assert one["losses"][-1] < one["losses"][0]  # it trains
    assert max_rel(fsdp["losses"], one["losses"]) <= RUN_REL
    assert max_rel(fsdp["grad_norms"], one["grad_norms"]) <= RUN_REL
    assert fsdp["weights"].keys() == one["weights"].keys()
    for name, value in one["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for run, export in ((one, "export-one"), (fsdp, "export-fsdp2")):
        assert safetensors_shapes(tmp_path / export) == safetensors_shapes(folder)  # HF's own layout
        torch.testing.assert_close(hf_logits(tmp_path / export), run["trained"], rtol=0, atol=LOGITS_ATOL)
    assert not torch.allclose(one["trained"], expected)
    # d9d's decoder units (d9d.parallel.decoder_units): one per layer, the embedding, [norm, lm_head];
    # a tied table is one unit with the head, after [norm]; nothing is left in the root
    params = set().union(*fsdp["units"])
    layers = {name.split(".")[2] for name in params if name.startswith("model.layers.")}
    expected = [{n for n in params if n.startswith(f"model.layers.{i}.")} for i in layers]
    if "lm_head.weight" in params:
        expected += [{"model.embed_tokens.weight"}, {"model.norm.weight", "lm_head.weight"}]
    else:
        expected += [{"model.norm.weight"}, {"model.embed_tokens.weight"}]
    assert not one["units"] and sorted(map(sorted, fsdp["units"])) == sorted(map(sorted, expected))


@pytest.mark.parametrize(
    ("mesh", "nproc"),
    [({"data_parallel_replicate": 2, "data_parallel_shard": 2}, 4), ({"data_parallel_replicate": 2}, 2)],
    ids=["hsdp2x2", "ddp2"],
)
def test_llama_on_hsdp_and_ddp_trains_like_one_process(tmp_path, folders, mesh, nproc):
    folder = folders["llama"]
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    config = hf_job(folder, tmp_path / "runs", name="split", mesh=mesh)
    run = run_distributed(train, nproc, config, tmp_path / "export-split", timeout=180)[0]
    assert max_rel(run["losses"], one["losses"]) <= RUN_REL
    assert max_rel(run["grad_norms"], one["grad_norms"]) <= RUN_REL
    for name, value in one["weights"].items():
        torch.testing.assert_close(run["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(hf_logits(tmp_path / "export-split"), one["trained"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # measured 74 s cold here (inductor compiling the decoder layers, 2 shared cores), 26 s warm
def test_llama_compiled_per_decoder_layer_trains_like_eager(tmp_path, folders):
    folder = folders["llama"]
    eager = train(hf_job(folder, tmp_path / "runs", name="eager"), tmp_path / "export-eager")
    config = hf_job(folder, tmp_path / "runs", name="compiled", trainer={"compile": {"enabled": True}})
    compiled = train(config, tmp_path / "export-compiled")
    assert compiled["keys"] == eager["keys"]  # compiled in place: Hugging Face's names, no _orig_mod.
    assert max_rel(compiled["losses"], eager["losses"]) <= RUN_REL
    assert max_rel(compiled["grad_norms"], eager["grad_norms"]) <= RUN_REL
    for name, value in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    exported = hf_logits(tmp_path / "export-compiled")
    torch.testing.assert_close(exported, compiled["trained"], rtol=0, atol=LOGITS_ATOL)


#: LoRA targets per architecture where Hugging Face's module names differ from Llama's.
_LORA_TARGETS = {
    "phi3": r".*\.(qkv_proj|gate_up_proj)",  # fused projections
    # attention only: for an MoE model PEFT turns the regex into leaf names, so `mlp.down_proj` would
    # also put a PEFT adapter on the fused experts' `down_proj`, which d9d's (Linear modules) leave alone
    "deepseek_v3": r".*\.(q_b_proj|kv_b_proj|o_proj)",
}


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_lora_fsdp2_adapters_load_in_peft_with_the_trained_logits(tmp_path, folders, model_type):
    folder = folders[model_type]
    target = _LORA_TARGETS.get(model_type, r".*\.(q_proj|v_proj|down_proj)")
    lora = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": [target]}}
    config = hf_job(
        folder,
        tmp_path / "runs",
        name="lora",
        mesh={"data_parallel_shard": 2},
        peft=lora,
        export={"lora": "both"},
    )
    run = run_distributed(train, 2, config, tmp_path / "export", timeout=120)[0]
    adapters = [k for k in run["keys"] if ".lora_" in k]
    assert adapters and all(k.startswith("model.layers.") for k in adapters)
    with_adapters = hf_logits(folder, adapter=tmp_path / "export" / "adapter")
    torch.testing.assert_close(with_adapters, run["trained"], rtol=0, atol=LOGITS_ATOL)
    torch.testing.assert_close(hf_logits(tmp_path / "export" / "merged"), run["trained"], rtol=0, atol=1e-5)
    assert not torch.allclose(with_adapters, hf_logits(folder))  # the adapters trained


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The input dtypes of every matmul (and attention) that runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._overloadpacket.__name__
        # attention: its first two inputs (q, k; grad_out, q in backward), not the float32 logsumexp
        inputs = args[:2] if "scaled_dot_product" in name else args
        if name in ("mm", "addmm", "bmm", "matmul", "linear") or "scaled_dot_product" in name:
            self.seen |= {a.dtype for a in inputs if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _bf16_run(config: dict) -> dict:
    """Train (one process or one rank), recording the input dtypes of the run's matmuls and attention."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config) as trainer:
        with _MatmulDtypes() as recorder:
            result = trainer.train()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        metrics = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
        return {
            "losses": result.losses,
            "grad_norms": [json.loads(line)["grad_norm"] for line in metrics],
            "weights": {name: t.detach().cpu().clone() for name, t in state.items()},
            "matmul_dtypes": recorder.seen,
        }


def test_llama_in_bfloat16_computes_in_bfloat16_and_fsdp2_follows_one_process(tmp_path, folders):
    """`trainer.precision.param_dtype: bfloat16` on the HF backend: every matmul and attention of the
    forward and backward takes bfloat16 inputs (on 1 process and FSDP 2), the master weights stay
    float32, and FSDP 2 follows one process within bfloat16's rounding."""
    folder = folders["llama"]
    bf16 = {"precision": {"param_dtype": "bfloat16"}}
    one = _bf16_run(hf_job(folder, tmp_path / "runs", name="one", trainer=bf16))
    fsdp = run_distributed(
        _bf16_run,
        2,
        hf_job(folder, tmp_path / "runs", name="fsdp2", mesh={"data_parallel_shard": 2}, trainer=bf16),
        timeout=180,
    )[0]
    for run in (one, fsdp):
        assert run["matmul_dtypes"] == {torch.bfloat16}, run["matmul_dtypes"]
        assert {t.dtype for t in run["weights"].values()} == {torch.float32}  # master weights
    assert one["losses"][-1] < one["losses"][0]
    # bf16 rounding differs with the reduction order (FSDP's reduce-scatter vs one process's sums)
    assert max_rel(fsdp["losses"], one["losses"]) <= 2e-2
    assert max_rel(fsdp["grad_norms"], one["grad_norms"]) <= 5e-2
    fp32 = _bf16_run(hf_job(folder, tmp_path / "runs", name="fp32"))
    assert fp32["matmul_dtypes"] == {torch.float32}
    assert max_rel(one["losses"], fp32["losses"]) <= 2e-2 and one["losses"] != fp32["losses"]  # bf16 ran


@pytest.mark.parametrize("model_type", [*ARCHITECTURES, *MORE_ARCHITECTURES])
def test_a_packed_row_computes_each_document_as_if_it_were_alone(tmp_path, model_type):
    """Packing on the HF backend rests on transformers keeping documents apart by their restarting
    position ids: a row of two packed documents gives each document's logits alone (float32, 1e-6),
    and the same tokens with continuing positions differ (the second document saw the first)."""
    from _tiny_hf import probe_batch

    from d9d.trainer.hf import HFCausalLM

    model = HFCausalLM(load_hf(save_tiny(model_type, tmp_path / model_type))).eval()
    ids, positions = probe_batch()  # documents of 10 and SEQ - 10 tokens
    with torch.no_grad():
        packed = model(ids, position_ids=positions)
        alone = torch.cat([model(ids[:, :10], position_ids=positions[:, :10]),
                           model(ids[:, 10:], position_ids=positions[:, 10:])], dim=1)  # fmt: skip
        continued = model(ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
    assert (continued[:, 10:] - alone[:, 10:]).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_mixtral_from_either_expert_layout_trains_fsdp2_like_one_process_and_exports_its_layout(
    tmp_path, layout
):
    """An MoE folder on the HF backend, as the Hub holds it (one weight per expert) or as transformers
    keeps it in memory (fused `gate_up_proj`/`down_proj`): the import gives transformers' logits,
    FSDP 2 follows one process, and the export has the folder's own layout and loads in transformers."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(MORE_ARCHITECTURES["mixtral"]())
    folder = tmp_path / layout
    hf.save_pretrained(folder, **({"save_original_format": False} if layout == "fused" else {}))
    expected = hf_logits(folder)
    one = train(hf_job(folder, tmp_path / "runs", name="one"), tmp_path / "export-one")
    fsdp = run_distributed(train, 2, hf_job(folder, tmp_path / "runs", name="fsdp2", mesh={"data_parallel_shard": 2}),
                           tmp_path / "export-fsdp2", timeout=180)[0]  # fmt: skip
    for run in (one, fsdp):
        torch.testing.assert_close(run["imported"], expected, rtol=0, atol=LOGITS_ATOL)
    assert one["losses"][-1] < one["losses"][0]
    assert max_rel(fsdp["losses"], one["losses"]) <= RUN_REL
    assert max_rel(fsdp["grad_norms"], one["grad_norms"]) <= RUN_REL
    for name, value in one["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for run, export in ((one, "export-one"), (fsdp, "export-fsdp2")):
        assert safetensors_shapes(tmp_path / export) == safetensors_shapes(folder)  # the folder's layout
        torch.testing.assert_close(hf_logits(tmp_path / export), run["trained"], rtol=0, atol=LOGITS_ATOL)
