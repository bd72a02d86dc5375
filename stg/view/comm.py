"""Communication per rank class, by collective type and by mesh axis, read from one rank of
each class (ranks of a class run the same program). Bytes are comm_size as written (Chakra's
convention, see README: Output); send and receive count as SEND / RECV."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import iter_nodes, node_attrs
from stg.chakra.rank_graph import coll_name
from stg.view.traceset import TraceSet


@dataclass(frozen=True)
class ClassComm:
    rank: int  # the rank read
    label: str
    by_type: dict[str, int]  # ALL_REDUCE, ..., SEND, RECV -> bytes per step
    by_axis: dict[str, int]  # `dp`, `tp`, `dp+tp`, `pp` -> bytes per step


def comm_by_class(trace_set: TraceSet) -> list[ClassComm]:
    found = []
    for rank in trace_set.representatives():
        by_type: Counter[str] = Counter()
        by_axis: Counter[str] = Counter()
        for node in iter_nodes(trace_set.out / f"workload.{rank}.et"):
            if node.type == pb.COMP_NODE:
                continue
            attrs = node_attrs(node)
            if node.type == pb.COMM_COLL_NODE:
                kind = coll_name(attrs["comm_type"])
                axes = trace_set.group_axes(trace_set.group_of(attrs.get("pg_name", "")))
            else:
                kind = "SEND" if node.type == pb.COMM_SEND_NODE else "RECV"
                axes = trace_set.axes_of((attrs["comm_src"], attrs["comm_dst"]))
            by_type[kind] += attrs["comm_size"]
            by_axis[axes] += attrs["comm_size"]
        label = trace_set.class_label(trace_set.rank_class(rank)) if trace_set.summary else f"rank {rank}"
        found.append(ClassComm(rank, label, dict(sorted(by_type.items())), dict(sorted(by_axis.items()))))
    return found
