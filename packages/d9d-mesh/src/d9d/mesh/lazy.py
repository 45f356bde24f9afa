"""Lazy public names for a package's `__init__` (PEP 562), shared by every d9d package.

    _EXPORTS = {"context": ("DistributedContext",), ...}        # module -> the names it defines
    _MODULE_OF, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

A name's module is imported on first use and the name is then kept in the package, so importing a
package (or one torch-free name of it) does not import everything behind it. Imports nothing itself.
"""

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]], namespace: MutableMapping[str, Any]
) -> tuple[dict[str, str], Callable[[str], Any], Callable[[], list[str]]]:
    """(name -> module, the package's `__getattr__`, its `__dir__`) for the names of `exports`.

    `package` is the package's `__name__`; `namespace` its `globals()` (its `__all__` is read when
    `__dir__` runs).
    """
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return module_of, __getattr__, __dir__
