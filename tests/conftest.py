"""Fixtures shared by the end-to-end tests of several modules."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example_with_demo(root: Path, name: str, *, beside: tuple[str, ...] = ()) -> Path:
    """A copy of examples/<name> under `root` (with the examples it imports, `beside`, and the shared
    data folder next to it, as in the repository) and its demo made (`<name>.py make-demo demo`); the
    config's relative paths point into it."""
    for example in (name, *beside):
        shutil.copytree(ROOT / "examples" / example, root / example,
                        ignore=shutil.ignore_patterns("demo", "runs", "export", "__pycache__"))  # fmt: skip
    (root / "data").symlink_to(ROOT / "examples" / "data")
    folder = root / name
    script = {"finetune": "finetune.py", "preference": "preference.py", "rl": "rl.py"}[name]
    subprocess.run([sys.executable, str(folder / script), "make-demo", "demo"], cwd=folder, check=True,
                   capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    return folder


@pytest.fixture(scope="session")
def finetune_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/finetune with its demo made (a tiny Qwen3 folder with its tokenizer and chat template,
    and conversations). Made once per session (~20 s): the fine-tune e2e and error tests share it,
    each with its own runs."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    return _example_with_demo(tmp_path_factory.mktemp("finetune"), "finetune")


@pytest.fixture(scope="session")
def preference_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/preference (beside the fine-tune example it takes its demo model from) with its demo
    made (the tiny Qwen3 folder and preference pairs). Made once per session."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    return _example_with_demo(tmp_path_factory.mktemp("preference"), "preference", beside=("finetune",))


@pytest.fixture(scope="session")
def rl_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/rl with its demo made (a random tiny Qwen3 with a 13-token tokenizer, and digit
    prompts). Made once per session."""
    pytest.importorskip("tokenizers")
    return _example_with_demo(tmp_path_factory.mktemp("rl"), "rl")
