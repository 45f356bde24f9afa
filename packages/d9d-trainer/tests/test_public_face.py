"""The public face of d9d.trainer: what a user needs, each name loaded on first use."""

import ast
import subprocess
import sys
from pathlib import Path

import d9d.trainer as trainer


def test_every_public_name_resolves_from_the_module_that_defines_it():
    # what a user of the trainer needs, not the CLI's internals (59: with the built-in prepared-data
    # provider, its config and mixture entry; 63: with plan_fit, its FitPlan and Lever, FIT_HEADROOM;
    # 65: with Callback and the RunControl its events get; run_command and report_job_error left for the
    # CLI, which imports them from their modules, as generate and SamplingConfig came)
    assert len(trainer.__all__) <= 65
    assert sorted(trainer.__all__) == sorted(trainer._MODULE_OF)
    for name in trainer.__all__:
        value = getattr(trainer, name)
        module = f"d9d.trainer.{trainer._MODULE_OF[name]}"
        assert getattr(sys.modules[module], name) is value, name
        assert name in dir(trainer)


def test_what_type_checkers_see_is_what_runs():
    """The `if TYPE_CHECKING:` imports of `__init__.py` name exactly the run-time exports."""
    tree = ast.parse(Path(trainer.__file__).read_text(encoding="utf-8"))
    guarded = next(node for node in tree.body if isinstance(node, ast.If))
    seen = {
        alias.name: node.module.removeprefix("d9d.trainer.")
        for node in guarded.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    assert seen == trainer._MODULE_OF


def test_an_unknown_name_is_an_attribute_error():
    try:
        trainer.RunLock  # noqa: B018 - internal to the trainer now: imported from d9d.trainer.faults.run_lock
    except AttributeError as exc:
        assert "RunLock" in str(exc)
    else:
        raise AssertionError("RunLock is not part of the public face")


def test_importing_the_package_imports_no_torch():
    code = "import sys, d9d.trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
