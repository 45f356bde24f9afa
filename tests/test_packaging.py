"""Every package builds a wheel holding only its own namespace portion, and installs and imports
from those wheels into a fresh virtual environment (no editable workspace involved)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["mesh", "parallel", "data", "ckpt", "trainer", "cli"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("uv") is None, reason="needs the uv executable"),
]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        ["uv", "build", "--all-packages", "--wheel", "-o", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def test_each_wheel_holds_its_own_namespace_portion(wheels):
    for name in PACKAGES:
        (wheel,) = wheels.glob(f"d9d_{name}-*.whl")
        files = zipfile.ZipFile(wheel).namelist()
        code = [f for f in files if not f.startswith(f"d9d_{name}-")]
        assert f"d9d/{name}/__init__.py" in code
        assert "d9d/__init__.py" not in code  # PEP 420: no package marker in the namespace
        assert all(f.startswith(f"d9d/{name}/") or f == "d9d/" for f in code), code


def _fresh_env(tmp_path, requirement, wheels):
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    subprocess.run(
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            str(venv / "bin" / "python"),
            "--find-links",
            str(wheels),
            requirement,
        ],
        check=True,
        capture_output=True,
    )
    return venv / "bin" / "python"


def test_mesh_installs_alone(tmp_path, wheels):
    python = _fresh_env(tmp_path, "d9d-mesh", wheels)
    code = "import d9d.mesh, importlib.util as u; print(d9d.mesh.MeshConfig().world_size, u.find_spec('d9d.ckpt'))"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "None"]  # works, and nothing else of d9d came along


def test_all_packages_install_together_from_wheels(tmp_path, wheels):
    python = _fresh_env(tmp_path, "d9d-cli", wheels)
    code = "; ".join(f"import d9d.{name}" for name in PACKAGES)
    subprocess.run([str(python), "-c", code], check=True)
