"""The packages' public faces load on first use (PEP 562): each name resolves to the object its module
defines, type checkers see the same names, and the names a config or a run directory needs import no
torch (d9d.trainer's own face is tested in its package)."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

LAZY = ["d9d.mesh", "d9d.ckpt", "d9d.ckpt.checkpoint", "d9d.parallel", "d9d.parallel.pipeline"]

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
        "PipelineConfig",
        "PIPELINE_SCHEDULES",
        "PipelineError",
    ],
}


@pytest.mark.parametrize("package", LAZY)
def test_every_public_name_resolves_from_the_module_that_defines_it(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._MODULE_OF)
    for name in module.__all__:
        value = getattr(module, name)
        owner = sys.modules[f"{package}.{module._MODULE_OF[name]}"]
        assert getattr(owner, name) is value, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", LAZY)
def test_what_type_checkers_see_is_what_runs(package):
    """The `if TYPE_CHECKING:` imports of `__init__.py` name exactly the run-time exports."""
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    guarded = next(node for node in tree.body if isinstance(node, ast.If))
    seen = {
        alias.name: node.module.removeprefix(f"{package}.")
        for node in guarded.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert seen == module._MODULE_OF


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
