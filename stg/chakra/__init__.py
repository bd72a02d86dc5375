"""Chakra execution traces: our schema (et_def.proto), a reader/writer of .et files, and a validator.

``reader`` reads and writes the on-disk format and renders nodes; ``validate`` checks a whole
output directory (rank files + workload.json) against what ASTRA-sim needs, including a replay
that finds cross-rank deadlocks. The function ``validate`` is not re-exported here: the name
would shadow the submodule; use ``from stg.chakra.validate import validate``.
"""

from stg.chakra.reader import (
    Trace,
    TraceFormatError,
    attr_kind,
    attr_value,
    format_node,
    iter_nodes,
    node_attrs,
    node_to_dict,
    read_trace,
    write_trace,
)
from stg.chakra.rank_graph import Problem

__all__ = [
    "Problem",
    "Trace",
    "TraceFormatError",
    "attr_kind",
    "attr_value",
    "format_node",
    "iter_nodes",
    "node_attrs",
    "node_to_dict",
    "read_trace",
    "write_trace",
]
