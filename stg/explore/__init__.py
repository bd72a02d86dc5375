"""Plan search: space (enumerate + prune), cost (the slice replay on a network model), search, report."""

from stg.explore.network import Network, load_network
from stg.explore.search import Result, Row, explore, write_top
from stg.explore.space import Cluster, Job, Space

__all__ = ["Cluster", "Job", "Network", "Result", "Row", "Space", "explore", "load_network", "write_top"]
