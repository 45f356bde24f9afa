"""The fine-tune example's `model.backend`: which code trains a Hugging Face folder, and what each
path runs.

- "auto" trains a Qwen3 folder with the reference model and a Gemma 2 folder (an architecture the
  reference model lacks) with transformers' own class, and the "job built" line says which and why;
  each run exports a folder transformers loads.
- The reference path, started from the folder's weights with LoRA, under tensor parallel 2 and
  pipeline parallel 2 equals one process (3 SGD steps, fp32, no clipping: every loss, grad norm,
  adapter and frozen weight), and a Qwen3-MoE folder under expert parallel 2 (x FSDP 2) does too.
- Folders that transformers saves of the other families (llama with llama3 RoPE scaling, qwen2,
  mistral, mixtral) train on the reference path: FSDP 2 (qwen2 also TP 2, mixtral EP 2 x FSDP 2)
  equals one process, and both exports load in transformers with the trained model's logits.
- "reference" on a Gemma 2 folder, and the transformers path on a pipeline-parallel mesh, are one
  line each, exit 2, before anything is written.

Ranks are forked from this process (`run_distributed`); REL is the e2e tests' 1e-5.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _quickstart import exported_weights, records, run_forked

from d9d.mesh.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"
STEPS = 3
REL = 1e-5
#: Bytes (CorpusProvider without a tokenizer): 257 ids.
VOCAB = 257
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": [r".*\.(q_proj|v_proj|down_proj)"]}


def _save_reference_folder(folder: Path, **extra: Any) -> Path:
    """A random reference model written as a Hugging Face folder (qwen3, or qwen3_moe with moe=)."""
    from d9d.trainer.models import ReferenceForCausalLM, ReferenceModelConfig, save_hf_pretrained

    torch.manual_seed(0)
    config = ReferenceModelConfig(**TINY, **extra)
    save_hf_pretrained(ReferenceForCausalLM(config), folder)
    return folder


def _save_gemma2_folder(folder: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401  (imported once here, not in every forked rank)

    from d9d.trainer.models import MoEConfig

    root = tmp_path_factory.mktemp("backends")
    moe = MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32)
    return {
        "qwen3": _save_reference_folder(root / "qwen3"),
        "qwen3_moe": _save_reference_folder(root / "qwen3_moe", moe=moe),
        "root": root,
    }


def _config(root: Path, name: str, model: dict[str, Any], *, lora: bool = True, **mesh: int) -> Path:
    """A fine-tune job of `model` on the byte corpus (SGD, fp32, no clipping), exporting the merged model."""
    config: dict[str, Any] = {
        "providers": {"model": f"{FINETUNE}:HFModelProvider", "dataset": f"{FINETUNE}:CorpusProvider"},
        "mesh": mesh,
        "model": model,
        "dataset": {"path": str(ROOT / "examples" / "data" / "corpus.txt"), "seq_len": 32},
        "data": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {
            "run": {"name": name},
            "schedule": {"total_steps": STEPS},
            "checkpointing": {"save_dir": "runs", "period_steps": STEPS},
            "logging": {"period_steps": 1, "progress_bar": False},
            "gradient_clipping": {"max_norm": None},
            "determinism": {"seed": 0},
        },
        "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.0},
        "lr_scheduler": {"name": "constant", "warmup_steps": 0},
        "export": {"dir": f"export-{name}", **({"lora": "merged"} if lora else {})},
    }
    if lora:
        config["peft"] = {"lora": LORA}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _train(config: str) -> dict[str, torch.Tensor]:
    """Train and export (forked); this rank's full-tensor view of its weights (adapters included)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config) as trainer:
        trainer.train()
        trainer.export()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {name: t.detach().cpu().clone() for name, t in state.items()}


def _run(config: Path, nproc: int) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    if nproc == 1:
        weights = run_forked(_train, str(config))
    else:
        weights = {}
        for rank_weights in run_distributed(_train, nproc, str(config)):
            weights.update(rank_weights)  # pipeline stages hold different names
    name = config.stem
    return records(config.parent / "runs" / name), weights


def _assert_equal_runs(actual: tuple, expected: tuple) -> None:
    (got, got_weights), (want, want_weights) = actual, expected
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, e in zip(got, want, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - e[key]) <= REL * abs(e[key]), (key, a["step"], a[key], e[key])
    assert sorted(got_weights) == sorted(want_weights)
    for name, tensor in want_weights.items():
        scale = float(tensor.float().norm()) or 1.0
        assert float((got_weights[name].float() - tensor.float()).norm()) <= REL * scale, name


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**env, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _job_built(output: str) -> str:
    (line,) = [line for line in output.splitlines() if "job built" in line]
    return line


def test_auto_trains_qwen3_with_the_reference_model_and_gemma2_with_transformers(folders):
    transformers = pytest.importorskip("transformers")
    root = folders["root"]
    gemma2 = _save_gemma2_folder(root / "gemma2")
    for folder, backend in ((folders["qwen3"], "reference"), (gemma2, "hf")):
        config = _config(root, f"auto-{folder.name}", {"hf_folder": str(folder)}, lora=False)
        done = _cli(str(FINETUNE), str(config), cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        line = _job_built(done.stdout)
        assert f"backend={backend}" in line and f"model_type={folder.name}" in line, line
        if backend == "hf":  # why: the reference model's refusal, one clause
            assert "backend_reason=" in line and "gemma2" in line.split("backend_reason=")[1], line
        else:
            assert "backend_reason" not in line, line
        assert [r["step"] for r in records(root / "runs" / config.stem)] == [1, 2, 3]
        exported = root / f"export-{config.stem}"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        assert loaded.config.model_type == folder.name
        weights = exported_weights(exported)
        source = exported_weights(folder)
        assert sorted(weights) == sorted(source)  # the folder's own names, every tensor trained
        assert any(not torch.equal(weights[k], source[k]) for k in source)


@pytest.mark.parametrize("mesh", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["tp2", "pp2"])
def test_the_reference_path_with_lora_under_tp2_and_pp2_equals_one_process(folders, mesh):
    root, model = folders["root"], {"hf_folder": str(folders["qwen3"]), "backend": "reference"}
    one = _run(_config(root, f"ref-one-{next(iter(mesh))}", model), 1)
    split = _run(_config(root, f"ref-{next(iter(mesh))}", model, **mesh), 2)
    assert any(".lora_" in n for n in one[1]) and one[0][-1]["loss"] != one[0][0]["loss"]
    _assert_equal_runs(split, one)


def test_a_qwen3_moe_folder_under_expert_parallel_2_equals_one_process(folders):
    root, model = folders["root"], {"hf_folder": str(folders["qwen3_moe"])}
    one = _run(_config(root, "moe-one", model, lora=False), 1)
    ep = _run(_config(root, "moe-ep2", model, lora=False, data_parallel_shard=2, expert_parallel=2), 2)
    _assert_equal_runs(ep, one)
    exported = json.loads((root / "export-moe-ep2" / "config.json").read_text())
    assert exported["model_type"] == "qwen3_moe"


def test_reference_on_gemma2_and_transformers_on_a_pp_mesh_are_one_line_before_anything_is_written(folders):
    pytest.importorskip("transformers")
    root = folders["root"] / "refused"
    root.mkdir()
    gemma2 = _save_gemma2_folder(root / "gemma2")
    cases = [
        (_config(root, "ref-gemma2", {"hf_folder": str(gemma2), "backend": "reference"}), [], "gemma2"),
        (
            _config(root, "hf-pp2", {"hf_folder": str(folders["qwen3"]), "backend": "hf"}),
            ["--world-size", "2", "--set", "mesh.pipeline_parallel=2"],
            "mesh.pipeline_parallel=2: the Hugging Face backend",
        ),
    ]
    for config, plan_args, expected in cases:
        done = (
            _cli("-m", "d9d.cli", "plan", str(config), *plan_args, cwd=root)
            if plan_args
            else _cli(str(FINETUNE), str(config), cwd=root)
        )
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2, done.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], errors
        assert "Traceback" not in done.stderr
    assert not (root / "runs").exists()


def _save_transformers_folder(folder: Path, model_type: str) -> Path:
    """A tiny random model of one of the reference model's other families, built and saved by transformers."""
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),  # scaled: 32 > 16 positions
        "qwen2": lambda: transformers.Qwen2Config(**common),  # q/k/v biases
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=64),  # >= seq_len: no effect
        "mixtral": lambda: transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
    }  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(configs[model_type]()).save_pretrained(folder)
    return folder


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def _train_with_logits(config: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One process: `_train`, and the trained model's logits on `_probe()`."""
    from d9d.trainer import Trainer

    with Trainer.from_config(config) as trainer:
        trainer.train()
        trainer.export()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(_probe()).float().clone()
        return {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}, logits


_ONE_PROCESS: dict[str, tuple[Any, ...]] = {}


@pytest.mark.parametrize(
    ("model_type", "mesh"),
    [
        ("llama", {"data_parallel_shard": 2}),
        ("llama", {"tensor_parallel": 2}),
        ("qwen2", {"data_parallel_shard": 2}),
        ("qwen2", {"tensor_parallel": 2}),
        ("mistral", {"data_parallel_shard": 2}),
        ("mistral", {"tensor_parallel": 2}),
        ("mixtral", {"data_parallel_shard": 2, "expert_parallel": 2}),
    ],
    ids=[
        "llama-fsdp2",
        "llama-tp2",
        "qwen2-fsdp2",
        "qwen2-tp2",
        "mistral-fsdp2",
        "mistral-tp2",
        "mixtral-ep2",
    ],
)
def test_transformers_folders_of_the_other_families_train_on_the_reference_path_like_one_process(
    folders, model_type, mesh
):
    transformers = pytest.importorskip("transformers")
    root = folders["root"] / "families"
    root.mkdir(exist_ok=True)
    model = {"hf_folder": str(root / model_type), "backend": "reference"}
    if model_type not in _ONE_PROCESS:  # one reference run per family, shared by its meshes
        _save_transformers_folder(root / model_type, model_type)
        config = _config(root, f"{model_type}-one", model, lora=False)
        weights, logits = run_forked(_train_with_logits, str(config))
        _ONE_PROCESS[model_type] = ((records(root / "runs" / config.stem), weights), logits)
        exported = transformers.AutoModelForCausalLM.from_pretrained(root / f"export-{config.stem}",
                                                                     dtype=torch.float32).eval()  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(exported(_probe()).logits, logits, rtol=0, atol=1e-5)
    one, logits = _ONE_PROCESS[model_type]
    assert one[0][-1]["loss"] < one[0][0]["loss"]  # it trains
    name = f"{model_type}-{'-'.join(f'{k}{v}' for k, v in mesh.items())}"
    split = _run(_config(root, name, model, lora=False, **mesh), 2)
    _assert_equal_runs(split, one)
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / f"export-{name}", dtype=torch.float32)
    assert sorted(exported_weights(root / f"export-{name}")) == sorted(exported_weights(root / model_type))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(_probe()).logits, logits, rtol=0, atol=1e-4)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's call
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "mixtral"])
def test_lora_on_the_reference_path_of_a_transformers_folder_loads_in_peft_with_the_trained_logits(
    tmp_path, model_type
):
    """LoRA through the reference model on a folder transformers wrote (llama3 RoPE scaling, q/k/v
    biases, mistral, mixtral): both exports (PEFT's adapter on the folder, and the merged model) give
    the trained model's logits in PEFT and transformers."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    folder = _save_transformers_folder(tmp_path / model_type, model_type)
    model = {"hf_folder": str(folder), "backend": "reference"}
    config = _config(tmp_path, f"{model_type}-lora", model, lora=True)
    job = yaml.safe_load(config.read_text())
    job["export"]["lora"] = "both"  # adapter/ in PEFT's layout and merged/
    if model_type == "mixtral":  # PEFT reads the regex as leaf names: `down_proj` would hit the fused experts
        job["peft"]["lora"]["target_modules"] = [r".*\.(q_proj|v_proj)"]
    config.write_text(yaml.safe_dump(job), encoding="utf-8")
    _, logits = run_forked(_train_with_logits, str(config))
    export = tmp_path / f"export-{model_type}-lora"
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, export / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()
    untrained = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for loaded in (adapted, merged):
            torch.testing.assert_close(loaded(_probe()).logits.float(), logits, rtol=0, atol=1e-5)
        assert not torch.allclose(untrained(_probe()).logits, logits, atol=1e-4)  # the adapters trained
