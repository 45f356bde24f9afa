"""Lazy public faces (PEP 562), shared by every d9d package: each exported name is listed once.

A package's `__init__.py` lists its public names as the imports of one `if TYPE_CHECKING:` block
(what type checkers see), then hands that block to `lazy_face`:

    from typing import TYPE_CHECKING

    from d9d.mesh.lazy import lazy_face

    if TYPE_CHECKING:
        from d9d.mesh.config import MeshConfig
        from d9d.mesh.context import DistributedContext

    __all__, __getattr__, __dir__ = lazy_face(__name__, globals())

`lazy_face` reads that block from the file (no second table to keep equal), so `__all__` and the
run-time imports are the type checkers' names by construction. A name's module is imported on first
use and the name is then kept in the package, so importing a package (or one torch-free name of it)
does not import everything behind it. A name a sub-face exports (`subfaces=("planning",)`) is
answered with where it lives now. Imports nothing itself but the standard library.
"""

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["FaceError", "face_table", "lazy_face"]


class FaceError(ImportError):
    """A name asked of a face that exports it from one of its sub-faces instead (an ImportError, so
    `from package import Name` shows this message rather than Python's generic one)."""


def face_table(init_file: str | Path) -> dict[str, str]:
    """Name -> defining module of a face, read from its `__init__.py`'s `if TYPE_CHECKING:` block.

    Raises:
        ValueError: the file has no such block, or a name in it is imported twice.
    """
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    block = next((node for node in tree.body if _is_type_checking(node)), None)
    if block is None:
        raise ValueError(f"{init_file}: no `if TYPE_CHECKING:` block listing the public names")
    table: dict[str, str] = {}
    for node in block.body:
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                name = alias.asname or alias.name
                if name in table:
                    raise ValueError(f"{init_file}: {name} is listed twice")
                table[name] = node.module
    return table


def lazy_face(
    package: str, namespace: MutableMapping[str, Any], *, subfaces: Iterable[str] = ()
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`__all__`, `__getattr__`, `__dir__`) of the package `package` whose globals are `namespace`.

    `subfaces`: sub-packages with faces of their own (e.g. "planning"); asking this face for one of
    their names raises a `FaceError` that names the sub-face.
    """
    module_of = face_table(namespace["__file__"])
    subfaces = tuple(subfaces)

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise _missing(package, name, subfaces)
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *module_of})

    return sorted(module_of), __getattr__, __dir__


def _missing(package: str, name: str, subfaces: tuple[str, ...]) -> Exception:
    if not name.startswith("__"):  # dunder probes (copy, pickle, doctest) get a plain AttributeError
        for sub in subfaces:
            spec = importlib.util.find_spec(f"{package}.{sub}")
            if spec is not None and spec.origin is not None and name in face_table(spec.origin):
                return FaceError(
                    f"{name} is not exported by {package} but by {package}.{sub}: "
                    f"from {package}.{sub} import {name}",
                    name=name,
                    path=sys.modules[package].__file__ if package in sys.modules else None,
                )
    return AttributeError(f"module {package!r} has no attribute {name!r}")


def _is_type_checking(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name | ast.Attribute)
        and (getattr(node.test, "id", None) or getattr(node.test, "attr", None)) == "TYPE_CHECKING"
    )
