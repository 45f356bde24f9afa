"""The public face of d9d.trainer: what a user needs, each name loaded on first use."""

import subprocess
import sys
from pathlib import Path

import d9d.trainer as trainer
from d9d.mesh.lazy import face_table


def test_the_face_is_what_a_user_of_the_trainer_needs():
    """At most 45 names: running a job, its config and errors, callbacks, generation, the built-in
    providers; the provider contract (`d9d.trainer.providers`) and the plan (`d9d.trainer.planning`)
    are faces of their own (each name is listed once: tests/test_lazy_exports.py checks every face)."""
    assert len(trainer.__all__) <= 45
    table = face_table(trainer.__file__)
    for name in trainer.__all__:
        value = getattr(trainer, name)
        assert getattr(sys.modules[table[name]], name) is value, name
    for sub in ("planning", "providers"):
        assert not set(trainer.__all__) & set(face_table(Path(trainer.__file__).parent / sub / "__init__.py"))


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
