"""Chakra execution traces: our schema (et_def.proto), a reader/writer of .et files, and a validator.

``reader`` reads and writes the on-disk format and renders nodes; ``validate`` checks a whole
output directory (rank files + workload.json) against what ASTRA-sim needs, including a replay
that finds cross-rank deadlocks. The function ``validate`` is not re-exported here: the name
would shadow the submodule; use ``from stg.chakra.validate import validate``.
"""

from importlib import import_module

# Imported on first use (PEP 562): a count or a trace written from the compact writer needs
# none of the reader, its protobuf schema or the validator's graph
_EXPORTS = {name: "stg.chakra.reader" for name in (
    "Trace", "TraceFormatError", "attr_kind", "attr_value", "format_node", "iter_nodes", "node_attrs",
    "node_to_dict", "read_trace", "write_trace")}
_EXPORTS["Problem"] = "stg.chakra.rank_graph"
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'stg.chakra' has no attribute {name!r}")
