"""The packages' layering: each imports only packages below it, and declares each one it imports."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Bottom-up; a package may import only those before it (d9d-data and d9d-ckpt only d9d-mesh).
BELOW = {
    "mesh": set(),
    "parallel": {"mesh"},
    "data": {"mesh"},
    "ckpt": {"mesh"},
    "trainer": {"mesh", "parallel", "data", "ckpt"},
    "cli": {"mesh", "parallel", "data", "ckpt", "trainer"},
}


def _imported_packages(package: str) -> dict[str, str]:
    """The other d9d packages that `package`'s sources import, each with one file that does."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "packages" / f"d9d-{package}" / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if len(parts) > 1 and parts[0] == "d9d" and parts[1] != package:
                    found.setdefault(parts[1], str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", list(BELOW))
def test_a_package_imports_only_those_below_it_and_declares_each(package):
    imported = _imported_packages(package)
    above = {name: where for name, where in imported.items() if name not in BELOW[package]}
    assert not above, f"d9d-{package} imports packages above it: {above}"
    project = tomllib.loads((ROOT / "packages" / f"d9d-{package}" / "pyproject.toml").read_text())["project"]
    declared = {dep.split("[")[0].split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}
    missing = {name: where for name, where in imported.items() if f"d9d-{name}" not in declared}
    assert not missing, f"d9d-{package} imports but does not declare: {missing}"
