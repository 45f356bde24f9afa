"""Bad Hugging Face folders through real processes: `python train.py config.yaml` refuses each with one
`error:` line naming the file and the fix, exits 2 and writes nothing; so does a job naming the
backend without transformers installed. And importing d9d never imports transformers."""

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _tiny_hf import hf_job, save_tiny

import d9d.trainer.hf  # noqa: F401  # imported once here, not in every forked job
from d9d.mesh.testing import wait_for_child
from d9d.trainer import Trainer  # noqa: F401

_LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))}


def _in_a_process(job: Callable[[], None], stderr: Path, *, without_transformers: bool = False) -> int:
    """`job()` in a forked process of its own, its stderr written to `stderr`; its exit status.

    `without_transformers`: the process cannot import transformers (as if it were not installed),
    and every d9d module is imported afresh there.
    """
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 3
        try:
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  # the fds, not pytest's capture
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            for name in _LAUNCHER:
                os.environ.pop(name, None)
            if without_transformers:
                for name in [m for m in sys.modules if m.split(".")[0] in ("transformers", "peft", "d9d")]:
                    del sys.modules[name]
                sys.modules["transformers"] = None  # type: ignore[assignment]  # import fails as if absent
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)  # no OpenMP pool: the parent's may have been busy when it forked
            job()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return wait_for_child(pid, 300)


def _train(config: Path, *, without_transformers: bool = False) -> tuple[int, list[str]]:
    """`python train.py config.yaml` (`d9d.trainer.main`) in a process of its own: (exit status, stderr lines)."""

    def job() -> None:
        os.chdir(config.parent)
        from d9d.trainer import main

        main([config.name])

    err = config.with_name("stderr.txt")
    code = _in_a_process(job, err, without_transformers=without_transformers)
    return code, [line for line in err.read_text().splitlines() if line.strip()]


def _case(root: Path, name: str, break_folder) -> Path:
    """A job directory whose model folder (`model/`, relative to the config) `break_folder` spoils."""
    job = root / name
    folder = save_tiny("llama", job / "model", max_shard_size="20KB")
    break_folder(folder)
    config = hf_job(Path("model"), Path("runs"))
    (job / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return job / "config.yaml"


def _drop_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _drop_a_shard(folder: Path) -> None:
    sorted(folder.glob("model-*.safetensors"))[1].unlink()


def _add_a_stray_shard(folder: Path) -> None:
    (folder / "model-00001-of-00009.safetensors").write_bytes(sorted(folder.glob("model-*"))[0].read_bytes())


def _narrow_the_mlp(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))


def _make_it_t5(folder: Path) -> None:  # an encoder-decoder: no causal LM in transformers
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))


CASES = {
    "no-config-json": (_drop_config, ["model.folder:", "has no config.json", "point model.folder"]),
    "shard-missing": (
        _drop_a_shard,
        ["model.folder:", "model.safetensors.index.json names 'model-0000", "copy that shard back"],
    ),
    "stray-shard": (
        _add_a_stray_shard,
        ["model.folder:", "model-00001-of-00009.safetensors is not named by", "remove the files"],
    ),
    "shape-mismatch": (
        _narrow_the_mlp,
        [
            "model.folder:",
            "config.json does not describe the weights beside it",
            "mlp.gate_proj.weight' of the target has shape (48, 32)",
            "gives (64, 32)",
            "use the config.json they were saved with",
        ],
    ),
    "t5": (_make_it_t5, ["config.json: model_type 't5' has no causal LM", "trains causal LMs only"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_folder_is_one_line_exit_2_and_nothing_written(tmp_path, case):
    break_folder, expect = CASES[case]
    config = _case(tmp_path, case, break_folder)
    before = _snapshot(config.parent)
    code, lines = _train(config)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(fragment in lines[0] for fragment in expect), lines[0]
    after = _snapshot(config.parent)
    assert {k: v for k, v in after.items() if k != "stderr.txt"} == before  # no run directory, no log


def test_without_transformers_the_job_names_the_extra(tmp_path):
    config = _case(tmp_path, "no-transformers", lambda folder: None)
    code, lines = _train(config, without_transformers=True)
    assert code == 2 and len(lines) == 1, lines
    assert "providers.model" in lines[0] and "pip install 'd9d-trainer[hf]'" in lines[0], lines[0]
    assert "uv sync --all-packages --extra hf" in lines[0]


def test_importing_d9d_does_not_import_transformers(tmp_path):
    def job() -> None:
        import d9d.ckpt
        import d9d.data
        import d9d.mesh
        import d9d.parallel
        import d9d.trainer

        for name in d9d.trainer.__all__:
            getattr(d9d.trainer, name)  # each name's module, loaded on first use

    assert _in_a_process(job, tmp_path / "stderr.txt", without_transformers=True) == 0, (
        tmp_path / "stderr.txt"
    ).read_text()[-3000:]
