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


def _modules(package: str) -> dict[str, Path]:
    src = ROOT / "packages" / f"d9d-{package}" / "src"
    return {
        ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted(src.rglob("*.py"))
    }


def _module_imports(path: Path, known: set[str]) -> set[str]:
    """The package's modules `path` imports at module level, type-only imports included (an import
    inside a function is a deliberate late one and no edge of the house)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(
                    m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in known
                )
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in known)
            for part in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, part, None)
                if isinstance(inner, list):
                    visit(inner)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


@pytest.mark.parametrize("package", list(BELOW))
def test_no_import_circle_in_a_package(package):
    """Within a package the imports run one way: no module reaches back to one that imports it, not
    even through a type-only import (a face's own lazy `if TYPE_CHECKING:` listing excepted)."""
    modules = _modules(package)
    graph = {
        name: set() if path.name == "__init__.py" else _module_imports(path, set(modules)) - {name}
        for name, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def strongconnect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            strongconnect(node)
    assert not circles, f"import circles in d9d-{package}: {circles}"


@pytest.mark.parametrize("package", list(BELOW))
def test_modules_and_functions_stay_small(package):
    """One owner per module: no source file over 500 lines, no function over 80."""
    too_long = []
    for name, path in _modules(package).items():
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 500:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno + 1 > 80
            ):
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
