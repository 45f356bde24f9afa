"""Fixtures shared by the end-to-end tests of several modules."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def finetune_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/finetune with its demo made (`make-demo`: a tiny Qwen3 folder with its
    tokenizer and chat template, and conversations); the config's relative paths point into it.
    Made once per session (~20 s): the fine-tune e2e and error tests share it, each with its own runs."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    folder = tmp_path_factory.mktemp("finetune") / "finetune"
    shutil.copytree(
        ROOT / "examples" / "finetune",
        folder,
        ignore=shutil.ignore_patterns("demo", "runs", "export", "__pycache__"),
    )
    (folder.parent / "data").symlink_to(ROOT / "examples" / "data")  # what the example finds next to it
    subprocess.run([sys.executable, str(folder / "finetune.py"), "make-demo", "demo"], cwd=folder, check=True,
                   capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    return folder


@pytest.fixture(scope="session")
def preference_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/preference (beside the fine-tune example it takes its demo model from) with its
    demo made (`make-demo`: a tiny Qwen3 folder with its tokenizer and chat template, and preference
    pairs); the config's relative paths point into it. Made once per session."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    root = tmp_path_factory.mktemp("preference")
    for name in ("preference", "finetune"):
        shutil.copytree(ROOT / "examples" / name, root / name,
                        ignore=shutil.ignore_patterns("demo", "runs", "export", "__pycache__"))  # fmt: skip
    (root / "data").symlink_to(ROOT / "examples" / "data")
    folder = root / "preference"
    subprocess.run([sys.executable, str(folder / "preference.py"), "make-demo", "demo"], cwd=folder, check=True,
                   capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    return folder


@pytest.fixture(scope="session")
def rl_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/rl with its demo made (`make-demo`: a random tiny Qwen3 with a 13-token
    tokenizer, and digit prompts); the config's relative paths point into it."""
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("rl") / "rl"
    shutil.copytree(
        ROOT / "examples" / "rl",
        folder,
        ignore=shutil.ignore_patterns("demo", "runs", "export", "__pycache__"),
    )
    subprocess.run([sys.executable, str(folder / "rl.py"), "make-demo", "demo"], cwd=folder, check=True,
                   capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    return folder
