"""The packages' public faces load on first use (PEP 562): each name is listed once (the face's
`if TYPE_CHECKING:` block, what type checkers see), resolves to the object its module defines, and
the names a config or a run directory needs import no torch (d9d.trainer's own face is tested in its
package)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from d9d.mesh.lazy import face_table

#: Every face of the workspace (d9d.trainer.hf needs transformers, a dev dependency here).
FACES = [
    "d9d.mesh",
    "d9d.parallel",
    "d9d.parallel.expert",
    "d9d.parallel.pipeline",
    "d9d.data",
    "d9d.ckpt",
    "d9d.trainer",
    "d9d.trainer.planning",
    "d9d.trainer.providers",
    "d9d.trainer.models",
    "d9d.trainer.hf",
]

#: Per package, the public names that must stay importable without torch: what `d9d checkpoints`,
#: `d9d plan` and `d9d train` use before they know they need a model.
TORCH_FREE = {
    "d9d.mesh": ["MeshConfig", "D9dError", "LaunchError", "check_launch", "configure_logging", "get_logger"],
    "d9d.ckpt": [
        "CheckpointError",
        "RunEntryKind",
        "classify_run_entry",
        "read_checkpoint_info",
        "list_checkpoints",
        "uncommitted_step_dirs",
        "check_checkpoint_files",
        "verify_checkpoint",
    ],
    "d9d.parallel": [
        "ActivationCheckpointingConfig",
        "CompileConfig",
        "LoraConfig",
        "PrecisionConfig",
    ],
    "d9d.parallel.pipeline": ["PipelineConfig", "PIPELINE_SCHEDULES", "PipelineError"],
    "d9d.trainer": ["JobConfig", "ConfigError", "load_job_config", "read_metrics", "TrainResult", "main"],
}


@pytest.mark.parametrize("package", FACES)
def test_every_public_name_resolves_from_the_module_that_defines_it(package):
    module = importlib.import_module(package)
    table = face_table(module.__file__)
    assert module.__all__ == sorted(table)
    for name in module.__all__:
        value = getattr(module, name)
        owner = sys.modules[table[name]]
        assert getattr(owner, name) is value, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", FACES)
def test_a_face_lists_each_name_once_from_its_defining_module(package):
    """The one listing is the `if TYPE_CHECKING:` block; it names the module that defines each name
    (never another face), and no public name is also a submodule's name, which the import system
    would bind over the public object once that submodule is imported."""
    module = importlib.import_module(package)
    init = Path(module.__file__)
    assert "__all__ = [" not in init.read_text(encoding="utf-8")
    for name, owner in face_table(init).items():
        defining = importlib.import_module(owner)
        assert not hasattr(defining, "__path__"), f"{package}.{name} is listed from the package {owner}"
        assert name in vars(defining) and getattr(defining, "__name__", owner) == owner
        assert not (init.parent / f"{name}.py").exists() and not (init.parent / name).is_dir(), name


def test_every_face_in_the_packages_is_tested():
    """A sub-package `__init__.py` either is a face (listed in FACES) or only describes its folder."""
    inits = Path(__file__).resolve().parents[1].glob("packages/*/src/d9d/**/__init__.py")
    found = {
        str(init.parent).split("/src/")[1].replace("/", ".")
        for init in inits
        if "lazy_face(" in init.read_text(encoding="utf-8")
    }
    assert found == set(FACES)


def test_a_name_that_moved_to_a_sub_face_says_where_it_is():
    with pytest.raises(ImportError, match=r"from d9d\.trainer\.planning import JobPlan"):
        from d9d.trainer import JobPlan  # noqa: F401
    with pytest.raises(ImportError, match=r"from d9d\.trainer\.providers import ModelProvider"):
        from d9d.trainer import ModelProvider  # noqa: F401
    with pytest.raises(ImportError, match=r"from d9d\.parallel\.expert import MoE"):
        from d9d.parallel import MoE  # noqa: F401
    with pytest.raises(ImportError, match=r"from d9d\.parallel\.pipeline import Pipeline"):
        from d9d.parallel import Pipeline  # noqa: F401


def test_config_and_run_directory_names_import_no_torch():
    code = (
        "import json, sys\n"
        f"for package, names in {TORCH_FREE!r}.items():\n"
        "    module = __import__(package, fromlist=names)\n"
        "    for name in names:\n"
        "        getattr(module, name)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    heavy = json.loads(out.stdout)
    assert "torch" not in heavy and "safetensors" not in heavy
