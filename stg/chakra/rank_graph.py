"""The compact per-rank view that validation and replay share, and the Problem they report."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from stg.chakra import et_def_pb2 as pb

COMP, SEND, RECV, COLL = pb.COMP_NODE, pb.COMM_SEND_NODE, pb.COMM_RECV_NODE, pb.COMM_COLL_NODE
ALL_RANKS = 0  # group id of pg_name ""/"0"/absent
# COLL: (group, comm_type, comm_size); SEND/RECV: (src, dst, tag, comm_size)
CommKey = tuple[int, ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a trace set; ``rank``/``node`` are None when it is not that local."""

    rank: int | None
    node: int | None
    reason: str

    def __str__(self) -> str:
        where = [f"rank {self.rank}"] if self.rank is not None else []
        if self.node is not None:
            where.append(f"node {self.node}")
        return f"{', '.join(where)}: {self.reason}" if where else self.reason


@dataclass(frozen=True)
class RankGraph:
    """A rank's nodes in ascending id (so an index is also the issue priority)."""

    rank: int
    ids: array  # node id by index ('Q'); the others are 'q'
    types: bytes  # NodeType by index
    child_start: array  # CSR: children of i are children[child_start[i]:child_start[i + 1]]
    children: array
    n_parents: array  # distinct data_deps per node
    comm: dict[int, CommKey]  # index -> comm key, for COLL/SEND/RECV nodes


def coll_name(ctype: int) -> str:
    try:
        return pb.CollectiveCommType.Name(ctype)
    except ValueError:
        return f"comm_type {ctype}"


def type_name(t: int) -> str:
    return pb.NodeType.Name(t) if t in pb.NodeType.values() else f"<{t}>"


def group_label(group: int) -> str:
    return "the all-ranks group" if group == ALL_RANKS else f"group {group}"


def p2p_text(kind: int, key: CommKey) -> str:
    src, dst, tag, size = key
    if kind == SEND:
        return f"SEND to rank {dst} (tag {tag}, {size} B)"
    return f"RECV from rank {src} (tag {tag}, {size} B)"
