"""Plan search: space (enumerate + prune), cost (the slice replay on a network model), search, report."""

import sys
import types

from stg.explore.network import Network, load_network
from stg.explore.search import Result, Row, explore, write_top
from stg.explore.space import Cluster, Job, Space

__all__ = ["Cluster", "Job", "Network", "Result", "Row", "Space", "explore", "load_network", "write_top"]


class _CallableModule(types.ModuleType):
    """`stg.explore(...)` is the search: the package and its function share the name, and once
    imported the package is what `stg.explore` is, so the package runs the search when called."""

    def __call__(self, *args, **kwargs) -> Result:
        return explore(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
