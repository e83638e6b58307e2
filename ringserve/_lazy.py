"""Lazy re-exports (PEP 562): a package's public names, each imported the first time it is read.

A package lists what it exports and the module each name lives in; ``import ringserve`` then loads
none of the layers it fronts (the worker, the coordinator, the parameter server), and a shard
process or a coordinator loads only its own. The names stay where users import them:
``ringserve.allreduce``, ``from ringserve import Worker``, ``from ringserve.ps import Client``.

The package keeps the same imports under ``TYPE_CHECKING``, for type checkers and readers;
tests/unit/test_lazy_imports.py checks that the two lists agree and that every name resolves.

Example (a package's ``__init__``):

```python
from typing import TYPE_CHECKING
from ringserve._lazy import exports

if TYPE_CHECKING:
    from ringserve.ps.client.aio import AsyncClient

__all__ = ["AsyncClient"]
__getattr__, __dir__ = exports(__name__, {"AsyncClient": "ringserve.ps.client.aio"})
```
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str], submodules: Iterable[str] = ()) -> tuple[
        Callable[[str], Any], Callable[[], list[str]]]:
    """The package's ``__getattr__`` and ``__dir__``: ``names`` maps each exported name to its
    module; ``submodules`` may be read as attributes before anyone imported them (``rs.api``), as
    an eager package had them."""
    module = sys.modules[package]
    table = dict(names)
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        where = table.get(name)
        if where is not None:
            value = getattr(_load(where), name)
        elif name in subs:
            value = _load(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)  # the next read is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *table, *subs})

    return __getattr__, __dir__


def _load(module: str) -> Any:
    """Imports ``module`` through the import statement's own path (``__import__``), which
    ``python -X importtime`` reports as it reports any import (importlib.import_module it does not)."""
    __import__(module)
    return sys.modules[module]
