"""`d9d init`: a quickstart that runs from any directory and exports what transformers loads, a fine-tune
of a folder from a config alone, a next step that runs, and no overwrite."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _cli_job import run_cli

from d9d.cli import cli
from d9d.cli.commands.init import TEMPLATE_FILES, d9d_invocation
from d9d.trainer import load_job_config, resolve_job

# A few steps of a smaller model, so the test stays fast; the shipped config itself is checked as is.
TINY = [
    "trainer.schedule.total_steps=2",
    "trainer.checkpointing.period_steps=0",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "dataset.seq_len=32",
    "data.global_batch_size=4",
    "data.microbatch_size=2",
    "export.dir=null",
]
ROOT = Path(__file__).resolve().parents[3]


def test_init_writes_a_valid_job(runner, tmp_path):
    target = tmp_path / "new" / "job"
    result = runner.invoke(cli, ["init", str(target)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in target.iterdir()) == sorted(TEMPLATE_FILES)
    loaded = load_job_config(target / "config.yaml")
    job = resolve_job(loaded)  # imports train.py from the new directory
    assert type(job.model_provider).__name__ == "ModelProvider"
    raw = yaml.safe_load((target / "config.yaml").read_text())
    assert raw["dataset"]["path"] == "corpus.txt" and (target / "corpus.txt").stat().st_size > 10_000


def test_init_refuses_to_overwrite(runner, tmp_path):
    (tmp_path / "config.yaml").write_text("mine")
    result = runner.invoke(cli, ["init", str(tmp_path)])
    assert result.exit_code == 2
    assert "config.yaml already exists" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "config.yaml").read_text() == "mine"
    assert not (tmp_path / "train.py").exists()  # nothing written


def test_init_into_a_file_is_an_error(runner, tmp_path):
    (tmp_path / "f").write_text("x")
    result = runner.invoke(cli, ["init", str(tmp_path / "f")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_init_then_train_from_another_directory(tmp_path):
    made = run_cli("init", "job", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sets = [arg for item in TINY for arg in ("--set", item)]
    ran = run_cli("train", str(tmp_path / "job" / "config.yaml"), *sets, cwd=elsewhere)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    # save_dir: runs is relative to the config file, wherever the job is started from
    assert (tmp_path / "job" / "runs" / "quickstart" / "save-2").is_dir()
    assert not (elsewhere / "runs").exists()
    again = run_cli("init", "job", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "Traceback" not in again.stderr


def _without_venv(environ: dict[str, str]) -> dict[str, str]:
    """The environment of the user's own shell: this environment's bin directory not on PATH."""
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in environ.items() if k not in ("VIRTUAL_ENV", "UV_RUN_RECURSION_DEPTH")}
    env["PATH"] = os.pathsep.join(p for p in environ.get("PATH", "").split(os.pathsep) if p != bindir)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return {**env, "OMP_NUM_THREADS": "1"}


def _next_steps(stdout: str) -> list[str]:
    """The commands `d9d init` prints (its indented lines)."""
    return [line.strip() for line in stdout.splitlines() if line.startswith("  ")]


def test_d9d_invocation_is_the_bare_name_only_when_the_shell_finds_this_d9d(tmp_path):
    bindir = Path(sys.executable).parent
    if not (bindir / "d9d").is_file():
        pytest.skip("d9d is not installed as a console script next to this interpreter")
    shell = _without_venv(dict(os.environ))
    activated = {**shell, "PATH": os.pathsep.join([str(bindir), shell["PATH"]])}
    assert d9d_invocation(activated) == "d9d"
    assert d9d_invocation(shell) == str(bindir / "d9d")  # not on PATH: its full path
    under_uv_run = {**activated, "UV_RUN_RECURSION_DEPTH": "1"}  # uv run's PATH is its child's only
    assert d9d_invocation(under_uv_run) == str(bindir / "d9d")


def test_next_step_printed_under_uv_run_runs_in_the_users_shell(tmp_path):
    """`uv run d9d init job` prints a command that trains from a shell without the venv on PATH."""
    shell = _without_venv(dict(os.environ))
    bindir = str(Path(sys.executable).parent)
    as_uv_run = {**shell, "PATH": os.pathsep.join([bindir, shell["PATH"]]), "VIRTUAL_ENV": str(Path(bindir).parent),
                 "UV_RUN_RECURSION_DEPTH": "1"}  # fmt: skip
    made = subprocess.run(
        [sys.executable, "-m", "d9d.cli", "init", "job"],
        cwd=tmp_path, env=as_uv_run, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    train, plan = _next_steps(made.stdout)
    assert train.startswith("cd job && ") and " train config.yaml" in train and " plan config.yaml" in plan
    assert not train.startswith("cd job && d9d ")  # the bare name is not on the user's PATH
    ran = subprocess.run(
        ["/bin/sh", "-c", f"{train} {' '.join(TINY)}"],
        cwd=tmp_path, env=shell, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert (tmp_path / "job" / "runs" / "quickstart" / "save-2").is_dir()


def test_the_quickstart_template_exports_a_llama_that_transformers_loads_with_the_same_logits(
    runner, tmp_path
):
    transformers = pytest.importorskip("transformers")
    import torch

    from d9d.trainer import Trainer

    assert runner.invoke(cli, ["init", str(tmp_path / "job")]).exit_code == 0
    tiny = [item for item in TINY if not item.startswith("export.")]
    with Trainer.from_config(tmp_path / "job" / "config.yaml", tiny) as trainer:
        trainer.train()
        out = trainer.export()
        ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ours = trainer.model(ids)
    assert (
        out == tmp_path / "job" / "export"
        and json.loads((out / "config.json").read_text())["model_type"] == "llama"
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = theirs(ids).logits
    assert torch.allclose(ours, logits, atol=1e-5, rtol=0), (ours - logits).abs().max()


@pytest.mark.parametrize("written", ["train.py", "config.yaml"])
def test_the_template_passes_ruff_with_the_projects_rules(runner, tmp_path, written):
    pytest.importorskip("ruff")
    assert runner.invoke(cli, ["init", str(tmp_path)]).exit_code == 0
    if written == "train.py":
        for command in (["check"], ["format", "--check"]):
            done = subprocess.run([sys.executable, "-m", "ruff", *command, "--config", str(ROOT / "pyproject.toml"),
                                   str(tmp_path / written)], capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
    else:  # what d9d reads, with every key checked
        load_job_config(tmp_path / written)


def test_a_finetune_template_is_a_config_of_built_in_providers(runner, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    result = runner.invoke(
        cli, ["init", str(tmp_path / "ft"), "--template", "finetune", "--from", str(folder)]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "ft").iterdir()) == ["chat.jsonl", "config.yaml"]
    raw = yaml.safe_load((tmp_path / "ft" / "config.yaml").read_text())
    assert raw["providers"] == {
        "model": "d9d.trainer:HFModelProvider",
        "dataset": "d9d.trainer:ChatDatasetProvider",
    }
    assert raw["model"]["hf_folder"] == str(folder) and raw["dataset"]["tokenizer"] == str(folder)
    lines = (tmp_path / "ft" / "chat.jsonl").read_text().splitlines()
    assert len(lines) > 100 and {m["role"] for m in json.loads(lines[0])["messages"]} == {"user", "assistant"}
    text = tmp_path / "corpus.txt"
    text.write_text("some text. " * 100)
    result = runner.invoke(cli, ["init", str(tmp_path / "pt"), "--template", "finetune", "--from", str(folder),
                                 "--data", str(text)])  # fmt: skip
    assert result.exit_code == 0, result.output
    raw = yaml.safe_load((tmp_path / "pt" / "config.yaml").read_text())
    assert raw["providers"]["dataset"] == "d9d.trainer:TextDatasetProvider" and raw["dataset"]["path"] == str(
        text
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--template", "finetune"], "--template finetune needs --from"),
        (["--template", "finetune", "--from", "nowhere"], "no config.json there"),
        (["--from", "x"], "add --template finetune"),
        (
            ["--template", "finetune", "--from", "{model}", "--data", "{model}/config.json"],
            "a .jsonl of conversations",
        ),
        (["--template", "finetune", "--from", "{bare}"], "no tokenizer.json"),
    ],
)
def test_bad_finetune_requests_are_one_line_and_write_nothing(runner, tmp_path, args, message):
    for name, files in (("model", ("config.json", "tokenizer.json")), ("bare", ("config.json",))):
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("{}")
    args = [a.format(model=tmp_path / "model", bare=tmp_path / "bare") for a in args]
    result = runner.invoke(cli, ["init", str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
