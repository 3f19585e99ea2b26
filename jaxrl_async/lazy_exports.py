"""Names a package exports but imports on first use (PEP 562), so importing one light submodule does not pull in
the heavy ones beside it (``jaxrl_async.checkpoint``'s signal handler without Orbax; the CLIs' ``data.tokenizer``
without grain).

In a package's ``__init__``::

    __getattr__, __dir__, __all__ = lazy_exports(__name__, globals(), {"manager": ("Checkpointer", ...), ...})

A name is imported from its submodule the first time it is read and then kept in the package's namespace (the
next read does not come here). ``submodules=True``: any other public attribute is tried as a submodule not yet
imported (``jaxrl_async.data.datasets`` read as an attribute before anyone imported it).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any], exports: Mapping[str, Iterable[str]], *,
                 submodules: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(``__getattr__``, ``__dir__``, ``__all__``) for ``package`` whose ``exports`` map submodule -> names."""
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            if submodules and not name.startswith("_"):
                try:
                    return importlib.import_module(f"{package}.{name}")
                except ModuleNotFoundError as err:
                    if err.name != f"{package}.{name}":
                        raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__, list(module_of)
