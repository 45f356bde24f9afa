"""The fine-tune example's bad inputs are one line and exit 2, through real processes, writing nothing:
a model folder without config.json, context parallelism with its packed rows (2 ranks), and a chat
role the template would render silently."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from faults._harness import Job, preload_distributed, start_job, start_ranks

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "examples" / "finetune" / "finetune.py"


def _run(tmp_path: Path, model: dict) -> subprocess.CompletedProcess[str]:
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


def test_context_parallel_with_packed_rows_is_refused_naming_dataset_pack_2ranks(tmp_path, finetune_example):
    preload_distributed()
    before = _snapshot(finetune_example)
    args = _finetune_args(tmp_path, "mesh.context_parallel=2")
    ranks = start_ranks(2, args, tmp_path, config=finetune_example / "config.yaml")  # logs: rank-N.txt
    line = _refusal(ranks[0])
    assert line.startswith("error: mesh.context_parallel=2 with packed documents"), line
    assert "set dataset.pack: false" in line and "or mesh.context_parallel: 1" in line, line
    assert ranks[1].wait() == 2, ranks[1].output()[-3000:]
    assert "error:" not in ranks[1].output() and "Traceback" not in ranks[1].output()  # said once
    assert not (tmp_path / "runs").exists() and not (tmp_path / "export").exists()  # no run dir, no lock
    assert _snapshot(finetune_example) == before


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
