"""The fine-tune example's bad inputs are one line and exit 2, through real processes, writing nothing:
a model folder without config.json, a chat role the template would render silently, and folders neither path trains (t5, an unknown model_type)
or the reference path refuses (an unknown RoPE type, a sliding window shorter than the sequence, a
missing or stray shard, weights config.json does not describe), and data whose vocabulary
exceeds the model's embedding on either path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from faults._harness import Job, start_job

from d9d.mesh.testing import wait_for_child

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"


def _config_file(tmp_path: Path, model: dict) -> Path:
    """A one-step fine-tune job of `model` on the byte corpus, written to tmp_path/config.yaml."""
    config = {
        "providers": {"model": f"{FINETUNE}:HFModelProvider", "dataset": f"{FINETUNE}:CorpusProvider"},
        "model": model,
        "dataset": {"path": str(ROOT / "examples" / "data" / "corpus.txt"), "seq_len": 32},
        "data": {"global_batch_size": 2, "microbatch_size": 1},
        "trainer": {
            "run": {"name": "bad"},
            "schedule": {"total_steps": 1},
            "checkpointing": {"save_dir": "runs"},
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _run(tmp_path: Path, model: dict) -> subprocess.CompletedProcess[str]:
    path = _config_file(tmp_path, model)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, str(FINETUNE), str(path)], capture_output=True, text=True,
                          timeout=120, env={**env, "OMP_NUM_THREADS": "1"})  # fmt: skip


def test_a_model_folder_without_config_json_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _run(tmp_path, {"hf_folder": "empty"})
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "no config.json" in errors[0], errors
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def _snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))}


def _refusal(job: Job) -> str:
    """The one `error:` line a refused job printed (it exited 2, with no traceback)."""
    code = job.wait()
    out = job.output()
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


def _finetune_args(tmp_path: Path, *extra: str) -> list[str]:
    """The example job, its run and export under tmp_path."""
    return [f"trainer.checkpointing.save_dir={tmp_path / 'runs'}", f"export.dir={tmp_path / 'export'}",
            "trainer.logging.progress_bar=false", *extra]  # fmt: skip


def test_an_unknown_chat_role_is_refused_with_its_file_and_line(tmp_path, finetune_example):
    rows = (finetune_example / "demo" / "chat" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    record = json.loads(rows[2])
    record["messages"][0]["role"] = "wizard"  # a chat template renders an unknown role without a word
    rows[2] = json.dumps(record)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(rows) + "\n", encoding="utf-8")
    before = _snapshot(finetune_example)
    job = start_job(_finetune_args(tmp_path, f"dataset.path={chat}"), tmp_path / "job.log",
                    config=finetune_example / "config.yaml")  # fmt: skip
    line = _refusal(job)
    assert f"{chat}:3: message 0 has role 'wizard'" in line, line
    assert "the roles accepted are system, user, assistant, tool" in line and "roles" in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "export").exists()
    assert _snapshot(finetune_example) == before


# ----------------------------------------------- folders neither path takes, and the reference path's checks


def _run_forked(tmp_path: Path, model: dict) -> tuple[int, list[str]]:
    """`python finetune.py config.yaml` as `_run` writes it, in a process forked from this one (torch
    and transformers already imported: ~1 s instead of ~15 s here): (exit status, stderr lines); its
    stdout is in tmp_path/stdout.txt."""
    import runpy
    import traceback

    import transformers  # noqa: F401  (imported once here, not in every child)

    config = _config_file(tmp_path, model)
    err = tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 3
        try:
            os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
            os.dup2(os.open(tmp_path / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  # the fds, not pytest's capture
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            for name in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
            ):
                os.environ.pop(name, None)
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)  # no OpenMP pool: the parent's may have been busy when it forked
            sys.argv = [str(FINETUNE), str(config)]
            runpy.run_path(str(FINETUNE), run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    code = wait_for_child(pid, 300)
    return code, [line for line in err.read_text().splitlines() if line.strip()]


def _llama_folder(
    folder: Path, *, max_shard_size: str | None = None, vocab_size: int = 257, **config: object
) -> Path:
    """A tiny random Llama saved by transformers (config.json keys in `config` then overridden)."""
    import json

    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    )  # fmt: skip
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}), encoding="utf-8")
    return folder


def _break_shards(folder: Path, how: str) -> Path:
    """A sharded folder with a shard its index names deleted ("missing") or one it does not name ("extra")."""
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    if how == "missing":
        shards[-1].unlink()
    else:
        (folder / "model-00001-of-00099.safetensors").write_bytes(shards[0].read_bytes())
    return folder


_FOLDER_CASES = {
    "t5": (lambda f: _llama_folder(f, model_type="t5"), "auto", ["model_type 't5'", "causal LM"]),
    "unknown-model-type": (lambda f: _llama_folder(f, model_type="no-such-llm"), "auto", ["'no-such-llm'"]),
    "unknown-rope": (
        lambda f: _llama_folder(f, rope_scaling={"rope_type": "no-such-rope", "factor": 2.0}),
        "reference",
        ["rope", "no-such-rope", "model.backend: hf"],
    ),
    "unknown-rope-auto": (  # neither path: the reference model refuses it, then transformers
        lambda f: _llama_folder(f, rope_scaling={"rope_type": "no-such-rope", "factor": 2.0}),
        "auto",
        ["no-such-rope"],
    ),
    "sliding-window": (
        lambda f: _llama_folder(f, model_type="mistral", sliding_window=8),
        "reference",
        ["sliding_window=8", "dataset.seq_len"],
    ),
    "missing-shard": (
        lambda f: _break_shards(_llama_folder(f, max_shard_size="20KB"), "missing"),
        "reference",
        ["model.safetensors.index.json names 'model-0000", "copy that shard back"],
    ),
    "extra-shard": (
        lambda f: _break_shards(_llama_folder(f, max_shard_size="20KB"), "extra"),
        "reference",
        ["model-00001-of-00099.safetensors is not named by", "remove the files"],
    ),
    # the byte corpus (ids up to 256) for a model of 200 tokens, on each path: the fix names the folder
    **{
        f"vocabulary-beyond-the-embedding-{backend}": (
            lambda f: _llama_folder(f, vocab_size=200),
            backend,
            [
                "token ids go up to 256",
                "input embedding has 200 rows",
                "vocab_size in",
                "model/config.json",
                "dataset.tokenizer",
            ],
        )
        for backend in ("reference", "hf")
    },
    "shape-mismatch": (
        lambda f: _llama_folder(f, intermediate_size=48),
        "reference",
        ["config.json does not describe the weights", "(48, 32)", "use the config.json they were saved with"],
    ),
}


@pytest.mark.parametrize("case", list(_FOLDER_CASES))
def test_a_folder_neither_path_trains_or_the_reference_path_refuses_is_one_line_naming_it(tmp_path, case):
    pytest.importorskip("transformers")
    make, backend, words = _FOLDER_CASES[case]
    make(tmp_path / "model")
    code, errors = _run_forked(tmp_path, {"hf_folder": "model", "backend": backend})
    assert code == 2 and len(errors) == 1 and errors[0].startswith("error: "), errors
    assert all(word in errors[0] for word in words), errors[0]
    assert not (tmp_path / "runs").exists()


def test_auto_trains_transformers_model_where_the_sliding_window_would_matter(tmp_path):
    """The reference model refuses sequences longer than a window; `model.backend: auto` then trains
    transformers' own model, which applies the window, and the job built line says why."""
    pytest.importorskip("transformers")
    _llama_folder(tmp_path / "model", model_type="mistral", sliding_window=8)
    code, errors = _run_forked(tmp_path, {"hf_folder": "model", "backend": "auto"})
    assert code == 0, errors
    (built,) = [x for x in (tmp_path / "stdout.txt").read_text().splitlines() if "job built" in x]
    assert "backend=hf" in built and "sliding_window=8" in built, built
    assert (tmp_path / "runs" / "bad" / "save-1").is_dir()
