"""Plan search: space (enumerate + prune), cost (the slice replay on a network model), search, report.

Names load on first use (PEP 562), so that `stg --help` and the CLI's other commands do not pay
for the search's imports (sympy among them)."""

import importlib
import sys
import types

_HOMES = {"Network": "network", "load_network": "network", "Result": "search", "Row": "search",
          "explore": "search", "write_top": "search", "Cluster": "space", "Job": "space", "Space": "space"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"stg.explore.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'stg.explore' has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """`stg.explore(...)` is the search: the package and its function share the name, and once
    imported the package is what `stg.explore` is, so the package runs the search when called."""

    def __call__(self, *args, **kwargs):
        from stg.explore.search import explore

        return explore(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
