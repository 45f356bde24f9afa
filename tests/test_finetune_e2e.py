"""The fine-tune example end to end: `make-demo` (a tiny Qwen3 folder with its tokenizer and chat
template, and conversations), SFT with LoRA on packed rows and validation, on one process, on
FSDP 2 and on PP 2 (equal), killed and resumed (equal to the uninterrupted run), and both exports loaded by
transformers and peft with our trained model's logits."""

import json
from pathlib import Path

import pytest
import torch
from _quickstart import records, run_forked

from d9d.mesh.testing import run_distributed

STEPS = 6
#: The example's config, smaller: 6 steps, a checkpoint every 2, an eval every 3 and at the end.
SMALL = [
    f"trainer.schedule.total_steps={STEPS}",
    "trainer.checkpointing.period_steps=2",
    "trainer.checkpointing.num_to_keep=3",
    "trainer.logging.progress_bar=false",
    "eval.period_steps=3",
    "data.global_batch_size=8",
    "data.microbatch_size=2",
]


@pytest.fixture
def example(finetune_example: Path) -> Path:
    """The example folder with its demo made (tests/conftest.py), shared with test_finetune_errors."""
    return finetune_example


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))


def _run(config: str, args: list[str]) -> dict[str, object]:
    """Train (resuming when the run has checkpoints) and export; our logits and the adapter weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config, args) as trainer:
        trainer.train()
        trainer.export()
        model = trainer.model
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        model.eval()
        with torch.no_grad():
            logits = model(_ids())
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    adapters = {n: t.detach().clone() for n, t in state.items() if ".lora_" in n}
    return {"logits": logits.float(), "adapters": adapters, "trainable": trainable}


def _args(example: Path, name: str, *extra: str) -> list[str]:
    return [*SMALL, f"trainer.run.name={name}", f"export.dir=export-{name}", *extra]


def _assert_records_equal(actual: list[dict], expected: list[dict], rel: float) -> None:
    assert [r["step"] for r in actual] == [r["step"] for r in expected]
    for key in ("loss", "grad_norm", "eval_loss"):
        for a, e in zip(actual, expected, strict=True):
            assert (key in a) == (key in e), (key, a["step"])
            if key in e:
                assert abs(a[key] - e[key]) <= rel * abs(e[key]), (key, a["step"], a[key], e[key])


def test_sft_with_lora_one_process_equals_fsdp2_and_both_exports_load_in_transformers_and_peft(example):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = str(example / "config.yaml")
    one = run_forked(_run, config, _args(example, "one"))
    fsdp = run_distributed(_run, 2, config, _args(example, "fsdp2", "mesh.data_parallel_shard=2"))[0]

    assert one["trainable"] and all(".lora_" in n for n in one["trainable"])  # only adapters train
    one_records, fsdp_records = records(example / "runs" / "one"), records(example / "runs" / "fsdp2")
    assert [r["step"] for r in one_records if "eval_loss" in r] == [3, 6]
    assert one_records[-1]["eval_loss"] < one_records[0]["loss"]  # it learned something on held-out data
    _assert_records_equal(fsdp_records, one_records, rel=1e-5)
    for name, tensor in one["adapters"].items():
        torch.testing.assert_close(fsdp["adapters"][name], tensor, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fsdp["logits"], one["logits"], rtol=0, atol=1e-5)

    # The checkpoints hold the adapters (and their optimizer state), not the frozen base (in demo/model).
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(example / "runs" / "one" / "save-6")).read_metadata().state_dict_metadata
    model_keys = sorted(k.removeprefix("model.") for k in stored if k.startswith("model."))
    assert model_keys == sorted(one["adapters"]), model_keys[:5]

    export = example / "export-one"
    merged = transformers.AutoModelForCausalLM.from_pretrained(export / "merged", torch_dtype=torch.float32)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(
        example / "demo" / "model", torch_dtype=torch.float32
    )
    adapted = peft.PeftModel.from_pretrained(base_model, export / "adapter")
    adapter_config = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert Path(adapter_config["base_model_name_or_path"]) == example / "demo" / "model"
    with torch.no_grad():
        for loaded in (merged.eval(), adapted.eval()):
            torch.testing.assert_close(loaded(_ids()).logits.float(), one["logits"], rtol=0, atol=1e-5)
    # The FSDP 2 exports are the same files' worth.
    merged_fsdp = transformers.AutoModelForCausalLM.from_pretrained(
        example / "export-fsdp2" / "merged", torch_dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(
            merged_fsdp.eval()(_ids()).logits.float(), one["logits"], rtol=0, atol=1e-5
        )
    # The FSDP 2 run's adapter checkpoint resumes on one process (the base rebuilt from demo/model),
    # and goes on as the one-process run does.
    more = [f"trainer.schedule.total_steps={STEPS + 2}"]
    run_forked(_run, config, [*_args(example, "one"), *more])
    run_forked(_run, config, [*_args(example, "fsdp2"), *more])
    _assert_records_equal(records(example / "runs" / "fsdp2"), records(example / "runs" / "one"), rel=1e-5)


def _train_and_export(config: str, args: list[str]) -> dict[str, torch.Tensor]:
    """Train and export as `d9d train` does; this rank's full-tensor view of its weights (its stages')."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from d9d.trainer import Trainer

    with Trainer.from_config(config, args) as trainer:
        trainer.train()
        trainer.export()
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        return {n: t.detach().clone() for n, t in state.items()}


@pytest.mark.parametrize(
    ("name", "extra"),
    [("lora-1f1b", ["pipelining.schedule=1f1b"]), ("full-interleaved", ["peft.lora=null", "pipelining.schedule=interleaved_1f1b"])],
)  # fmt: skip
def test_the_example_with_its_eval_on_pp2_equals_one_process(example, name, extra):
    """The example's config (packed chat rows, AdamW, clipping, evals at 3 and 6, both exports) on
    pipeline parallelism 2: the stages get the rows' document ids and positions, the evals run through
    the pipeline. Measured (relative): losses within 9.1e-8, grad norms 1.1e-7, eval losses 8.2e-9
    (LoRA: identical), weights 2.9e-7 (LoRA: the adapters identical)."""
    from safetensors.torch import load_file

    config = str(example / "config.yaml")
    one = run_forked(_train_and_export, config, _args(example, f"one-{name}", *extra))
    ranks = run_distributed(
        _train_and_export, 2, config, _args(example, f"pp2-{name}", "mesh.pipeline_parallel=2", *extra)
    )
    got = {n: t for rank in ranks for n, t in rank.items()}
    expected_records = records(example / "runs" / f"one-{name}")
    assert [r["step"] for r in expected_records if "eval_loss" in r] == [3, 6]
    _assert_records_equal(records(example / "runs" / f"pp2-{name}"), expected_records, rel=1e-5)
    assert got.keys() == one.keys()
    for n, tensor in one.items():
        assert float((got[n] - tensor).norm()) <= 1e-5 * float(tensor.norm()) + 1e-12, n
    folder = "merged/" if "peft.lora=null" not in extra else ""  # LoRA: the merged model beside the adapter
    merged = [
        load_file(example / f"export-{run}-{name}" / f"{folder}model.safetensors") for run in ("pp2", "one")
    ]
    assert merged[0].keys() == merged[1].keys()
    for n, tensor in merged[1].items():
        torch.testing.assert_close(merged[0][n], tensor, rtol=1e-5, atol=1e-6)


def test_sft_with_lora_killed_and_resumed_equals_the_uninterrupted_run(example):
    config = str(example / "config.yaml")
    straight = run_forked(_run, config, _args(example, "straight"))
    kill = {"D9D_TEST_SIGNAL_AT_STEP": "5", "D9D_TEST_SIGNAL": "KILL"}  # after save-4, before step 5
    with pytest.raises(AssertionError, match="died"):
        run_forked(_run, config, _args(example, "killed"), env=kill)
    assert [r["step"] for r in records(example / "runs" / "killed")][-1] == 4
    resumed = run_forked(_run, config, _args(example, "killed"))
    _assert_records_equal(records(example / "runs" / "killed"), records(example / "runs" / "straight"), rel=0)
    torch.testing.assert_close(resumed["logits"], straight["logits"], rtol=0, atol=0)


def test_full_sft_on_packed_chat_rows_equals_a_plain_pytorch_loop(example):
    # The anchor outside the trainer (tests/test_trainer_anchor.py) on the fine-tune path: packed chat
    # rows whose loss mask leaves most tokens out, so the loss must be normalized by the labelled tokens
    # of the whole step, and attention must stay within each conversation (position and document ids).
    from test_trainer_anchor import Settings, assert_trainer_equals_loop, trainer_and_loop

    settings = Settings(steps=STEPS, warmup=3, lr=2e-3, weight_decay=0.0, max_norm=1.0)
    args = _args(
        example,
        "anchor",
        "peft.lora=null",
        "eval.period_steps=0",
        "trainer.checkpointing.period_steps=0",
        "trainer.loss.fused=false",  # the loop's full-logits loss (tests/test_trainer_anchor.py says why)
    )
    got = run_forked(trainer_and_loop, str(example / "config.yaml"), args, settings, timeout=300)
    assert got["microbatches"] == 4 and got["ignored"] > 0  # accumulation; masked tokens in the rows
    assert_trainer_equals_loop(got, settings)


def test_d9d_init_finetune_of_a_folder_trains_and_exports_what_transformers_loads(example, tmp_path):
    """`d9d init --template finetune --from FOLDER`: a config of built-in providers alone (and sample
    conversations) that trains LoRA on the folder; the merged export gives the trained model's logits."""
    transformers = pytest.importorskip("transformers")
    from click.testing import CliRunner

    from d9d.cli import cli

    folder = example / "demo" / "model"
    made = CliRunner().invoke(
        cli, ["init", str(tmp_path / "ft"), "--template", "finetune", "--from", str(folder)]
    )
    assert made.exit_code == 0, made.output
    args = ["trainer.schedule.total_steps=2", "dataset.seq_len=64", "data.global_batch_size=4",
            "trainer.logging.progress_bar=false"]  # fmt: skip
    run = _run(str(tmp_path / "ft" / "config.yaml"), args)
    merged = tmp_path / "ft" / "export" / "merged"
    assert (tmp_path / "ft" / "export" / "adapter" / "adapter_config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(_ids()).logits
    assert torch.allclose(run["logits"], theirs, atol=1e-5, rtol=0), (run["logits"] - theirs).abs().max()
    assert run["trainable"] and all(".lora_" in name for name in run["trainable"])


def test_the_example_config_alone_trains_outside_the_repository(example, tmp_path):
    """No Python file of the user's: config.yaml copied next to a model folder and data, anywhere."""
    import shutil

    from d9d.trainer import Trainer

    shutil.copy(example / "config.yaml", tmp_path / "config.yaml")
    shutil.copytree(example / "demo", tmp_path / "demo")
    assert not list(tmp_path.glob("*.py"))
    args = ["trainer.schedule.total_steps=1", "eval.period_steps=0", "export.dir=null",
            "trainer.logging.progress_bar=false"]  # fmt: skip
    with Trainer.from_config(tmp_path / "config.yaml", args) as trainer:
        result = trainer.train()
    assert result.final_step == 1 and (tmp_path / "runs" / "finetune" / "save-1").is_dir()


#: The example at 4× the sequence it trains at (dataset.seq_len 128): what docs/fine-tune.md, "Long
#: context", runs. The demo's conversations pack into 95 rows of 512 tokens (97.8% filled).
LONG = ["dataset.seq_len=512", "eval_dataset.seq_len=512"]


@pytest.mark.parametrize("mesh", ["mesh.context_parallel=2", "mesh.pipeline_parallel=2"])
def test_the_example_at_four_times_its_context_on_cp2_and_pp2_equals_one_process(example, mesh):
    """Packed chat rows of 512 tokens (LoRA, AdamW, clipping, evals at 3 and 6) on CP 2 (each rank 256
    tokens of every row, the documents crossing the chunks) and on PP 2 (the rows' document ids and
    positions given to both stages): the one-process losses, grad norms and eval losses (1e-5
    relative) and weights (1e-4: AdamW's first steps on lora_B, which starts at zero, amplify the
    reduction order). Measured: CP 2 within 4.9e-5 (a gate_proj lora_B, norm relative), PP 2 identical."""
    config = str(example / "config.yaml")
    name = mesh.split(".")[1].split("=")[0]
    one = run_forked(_train_and_export, config, _args(example, "long-one", *LONG))
    ranks = run_distributed(_train_and_export, 2, config, _args(example, f"long-{name}", *LONG, mesh))
    got = {n: t for rank in ranks for n, t in rank.items()}
    expected = records(example / "runs" / "long-one")
    assert [r["step"] for r in expected if "eval_loss" in r] == [3, 6]
    assert expected[-1]["eval_loss"] < expected[0]["loss"]
    _assert_records_equal(records(example / "runs" / f"long-{name}"), expected, rel=1e-5)
    assert got.keys() == one.keys() and any(".lora_" in n for n in one)
    spread = {n: float((got[n] - t).norm()) / (float(t.norm()) + 1e-12) for n, t in one.items()}
    assert max(spread.values()) <= 1e-4, max(spread.items(), key=lambda item: item[1])
