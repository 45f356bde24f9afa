"""LoRA from the job config (`peft.lora`): FSDP 2 equals one process, only the adapters train, and the
export loads in PEFT with our trained model's logits."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _quickstart import CONFIG, NO_CLIP, SGD, compare_runs, exported_weights, overrides, run_forked, train

LORA = r"peft.lora={rank: 4, alpha: 8, target_modules: ['.*\.(q_proj|v_proj)']}"
STEPS = 3


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _initial_weights(args: list[str]) -> dict[str, torch.Tensor]:
    """The job's weights as built, before any step (the seeded initialization)."""
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        return {n: t.detach().cpu().clone() for n, t in trainer.model.state_dict().items()}


def _train_and_inspect(args: list[str]) -> dict[str, object]:
    """Train one process; the final weights, which parameters have optimizer state, and our logits."""
    from d9d.trainer import Trainer

    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.train()
        trainer.export()
        model = trainer.model
        names = {id(p): n for n, p in model.named_parameters()}
        with_state = sorted(names[id(p)] for p, s in trainer.optimizer.state.items() if s)
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        model.eval()
        with torch.no_grad():
            logits = model(ids)
            logits = getattr(logits, "logits", logits).float()
        weights = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    return {
        "weights": weights,
        "with_state": with_state,
        "trainable": trainable,
        "ids": ids,
        "logits": logits,
    }


def _export_base(args: list[str]) -> None:
    """Export the untrained base (no `peft.lora`) in the quickstart's Hugging Face layout."""
    from d9d.trainer import Trainer

    with Trainer.from_config(CONFIG, args) as trainer:
        trainer.export()


def test_lora_fsdp2_equals_one_process_and_exports_adapter_and_merged(tmp_path):
    from safetensors.torch import load_file

    args = [*SGD, *NO_CLIP, LORA, "trainer.checkpointing.period_steps=0", "export.lora=both"]
    one = train(1, overrides(tmp_path, "one", STEPS, *args, f"export.dir={tmp_path / 'x1'}"))
    fsdp = train(
        2,
        overrides(
            tmp_path, "fsdp2", STEPS, *args, "mesh.data_parallel_shard=2", f"export.dir={tmp_path / 'x2'}"
        ),
    )
    assert any(_is_adapter(n) for n in one.weights)
    compare_runs(fsdp, one, rel=1e-5)
    # the exports of the sharded run are gathered whole, and equal the one-process ones
    a, b = (load_file(tmp_path / x / "adapter" / "adapter_model.safetensors") for x in ("x1", "x2"))
    assert sorted(a) == sorted(b) and len(a) == 8
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-7)
    assert sorted(p.name for p in (tmp_path / "x2" / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged_one, merged_fsdp = (exported_weights(tmp_path / x / "merged") for x in ("x1", "x2"))
    assert sorted(merged_one) == sorted(merged_fsdp) and not any("lora" in k for k in merged_one)
    for key in merged_one:
        torch.testing.assert_close(merged_fsdp[key], merged_one[key], rtol=1e-5, atol=1e-7)
    # merged = base + B @ A * alpha / rank, the adapters from the adapter export
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    delta = a[f"{prefix}.lora_B.weight"] @ a[f"{prefix}.lora_A.weight"] * (8 / 4)
    assert float(delta.abs().max()) > 0
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged_one[q], one.weights[q] + delta, rtol=1e-5, atol=1e-6)


def test_lora_trains_only_adapters_and_exports_what_peft_loads(tmp_path):
    common = [*SGD, "optimizer.momentum=0.9", *NO_CLIP, "trainer.checkpointing.period_steps=0"]
    initial = run_forked(_initial_weights, overrides(tmp_path, "init", STEPS, *common))
    export = tmp_path / "adapter"
    result = run_forked(
        _train_and_inspect, overrides(tmp_path, "lora", STEPS, *common, LORA, f"export.dir={export}")
    )
    weights = result["weights"]
    adapters = sorted(n for n in weights if _is_adapter(n))
    assert len(adapters) == 8  # q_proj, v_proj × 2 layers × (A, B)
    assert result["trainable"] == adapters
    assert result["with_state"] == adapters  # momentum buffers: for the adapters only
    # the base is exactly the no-LoRA initialization: frozen, and drawn as without adapters
    assert sorted(n for n in weights if not _is_adapter(n)) == sorted(initial)
    for name, tensor in initial.items():
        assert torch.equal(weights[name], tensor), f"{name} changed"
    assert any(float(weights[n].abs().max()) > 0 for n in adapters if ".lora_B." in n), "B never trained"

    # (c) PEFT on transformers: the no-LoRA export of the same initial weights + our adapter
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    base = tmp_path / "base"
    run_forked(_export_base, overrides(tmp_path, "base", STEPS, *common, f"export.dir={base}"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, export).eval()
    with torch.no_grad():
        theirs = model(result["ids"]).logits.float()
    torch.testing.assert_close(theirs, result["logits"], rtol=0, atol=1e-5)
    with model.disable_adapter(), torch.no_grad():  # the adapter is what makes them equal
        assert not torch.allclose(model(result["ids"]).logits.float(), result["logits"], atol=1e-5)


def test_lora_configured_but_not_applied_is_refused():
    from d9d.parallel import LoraConfig, apply_lora
    from d9d.trainer import TrainingError
    from d9d.trainer.build.model import check_lora_applied

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    check_lora_applied(model, None)
    with pytest.raises(
        TrainingError, match=r"peft.lora is set .* call d9d.parallel.apply_lora\(model, context.lora\)"
    ):
        check_lora_applied(model, LoraConfig(target_modules=["0"]))
    apply_lora(model, LoraConfig(target_modules=["0"]))
    check_lora_applied(model, LoraConfig(target_modules=["0"]))


_IMPORTING_PROVIDER = """
import sys
from pathlib import Path
sys.path.insert(0, {quickstart!r})
from train import QuickstartModelProvider
from d9d.trainer.models import hf_checkpoint_keys, hf_import_mapper
from d9d.trainer.providers import PrepareImportModelStageResult

class ImportingProvider(QuickstartModelProvider):
    def prepare_import_model_stage(self, context):
        folder = Path({folder!r})
        mapper = hf_import_mapper(self.config, source_keys=hf_checkpoint_keys(folder))
        return PrepareImportModelStageResult(folder=folder, mapper=mapper)
"""


def test_lora_starts_from_the_imported_base_and_names_it(tmp_path):
    import json

    common = [*SGD, *NO_CLIP, "trainer.checkpointing.period_steps=0"]
    base = tmp_path / "base"  # another seed than the LoRA run's: the import must overwrite the init
    run_forked(
        _export_base,
        overrides(tmp_path, "base", STEPS, *common, "trainer.determinism.seed=1", f"export.dir={base}"),
    )
    provider = tmp_path / "importing.py"
    quickstart = str(Path(CONFIG).parent)
    provider.write_text(_IMPORTING_PROVIDER.format(quickstart=quickstart, folder=str(base)))
    export = tmp_path / "adapter"
    result = run_forked(
        _train_and_inspect,
        overrides(
            tmp_path,
            "lora",
            STEPS,
            *common,
            LORA,
            f"export.dir={export}",
            f"providers.model={provider}:ImportingProvider",
        ),
    )
    imported = run_forked(
        _initial_weights, overrides(tmp_path, "seed1", STEPS, *common, "trainer.determinism.seed=1")
    )
    for name, tensor in imported.items():
        assert torch.equal(result["weights"][name], tensor), f"{name} is not the imported base's"
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    # its checkpoint names that base: a file the import does not read changes nothing, other
    # weights of the same shapes (another training of the model) are refused on resume
    from safetensors.torch import save_file

    save_file({"extra": torch.zeros(2)}, base / "extra.safetensors")
    lora = overrides(
        tmp_path, "lora", STEPS + 1, *common, LORA, f"providers.model={provider}:ImportingProvider"
    )
    train(1, lora)
    run_forked(_export_base, overrides(tmp_path, "base2", STEPS, *common, "trainer.determinism.seed=2",
                                       f"export.dir={base}"))  # fmt: skip
    lora = overrides(
        tmp_path, "lora", STEPS + 2, *common, LORA, f"providers.model={provider}:ImportingProvider"
    )
    with pytest.raises(
        AssertionError, match=r"the base folder of LoRA checkpoint .* now holds other weights"
    ):
        train(1, lora)


def test_lora_checkpoints_hold_only_the_adapters_and_resume_on_their_base(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    args = [*SGD, "optimizer.momentum=0.9", *NO_CLIP, LORA, "trainer.checkpointing.period_steps=2"]
    straight = train(1, overrides(tmp_path, "straight", 4, *args))
    train(1, overrides(tmp_path, "resumed", 2, *args))
    stored = FileSystemReader(str(tmp_path / "resumed" / "save-2")).read_metadata().state_dict_metadata
    model_keys = sorted(k.removeprefix("model.") for k in stored if k.startswith("model."))
    assert len(model_keys) == 8 and all(_is_adapter(k) for k in model_keys), model_keys
    assert all(_is_adapter(k) for k in stored if k.startswith("optimizer.state."))
    resumed = train(1, overrides(tmp_path, "resumed", 4, *args))
    compare_runs(resumed, straight, rel=0)  # the base was rebuilt as it was: bit-exact
    # a TP 2 adapter checkpoint (replicated adapters' momentum included) resumes on one process
    train(2, overrides(tmp_path, "tp2", 2, *args, "mesh.tensor_parallel=2"))
    compare_runs(train(1, overrides(tmp_path, "tp2", 4, *args)), straight, rel=1e-5)
    # the adapters only fit the base they were trained on: another seed's initialization is refused
    with pytest.raises(
        AssertionError, match=r"the base of LoRA checkpoint .* was the initialization of seed 0"
    ):
        train(1, overrides(tmp_path, "resumed", 6, *args, "trainer.determinism.seed=1"))
    without = [a for a in args if a != LORA]
    with pytest.raises(AssertionError, match=r"holds only LoRA adapters .* has no peft.lora"):
        train(1, overrides(tmp_path, "resumed", 6, *without))
