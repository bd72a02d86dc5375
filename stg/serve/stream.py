"""Writing a serving set: each rank's iterations streamed from its stage's template, by bytes.

An iteration of a stage always has the same nodes, so its Chakra records have one layout: the
numbers that change between iterations (node ids and dependencies, FLOPs, bytes, durations,
message sizes, tags) are fixed-width varints (continuation bits on the padding, as the
training writer writes rank numbers; every protobuf parser accepts them), written into the
layout with one vectorized scatter per kind; a rank's group ids and peers are holes patched per
rank (stg/chakra/writer.py's scheme). Iteration i + 1's first compute depends on iteration i's
last compute and its first message on iteration i's last one; send/recv tags are
tag + i x edges. Memory: one layout per stage (two: the first iteration has no predecessor)
and one iteration's bytes, however many iterations and ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stg.chakra import writer as w
from stg.program import GroupHole, NodeType, RankHole
from stg.serve.template import StageTemplate

WIDTH = {"id": None, "flops": 9, "nbytes": 9, "duration": 5, "comm": 9, "tag": 5}


def _slot_attr(name: str, field: int, width: int) -> bytes:
    head = w._len_field(w._ATTR_NAME, name.encode()) + w._key(field, w._VARINT)
    return w._key(w._ATTR, w._LEN) + w.varint(len(head) + width) + head


@dataclass(frozen=True)
class Layout:
    body: np.ndarray  # uint8, slots zero
    slots: dict  # kind -> positions (start bytes), in node order of that kind
    dep_offsets: np.ndarray  # per dep slot: its value minus the iteration's first node id
    holes: tuple  # (Hole, [k, width] positions)


def links(nodes) -> list[tuple[int, ...]]:
    """Per node, its dependencies on the previous iteration (of the same nodes), as offsets from
    this iteration's first id: a node that follows no compute of its own iteration follows the
    previous iteration's last compute; the first message follows the previous last message."""
    n = len(nodes)
    compute = [i for i, x in enumerate(nodes) if x.type is NodeType.COMP_NODE]
    comm = [i for i, x in enumerate(nodes) if x.type is not NodeType.COMP_NODE]
    out = []
    for i, node in enumerate(nodes):
        extra = []
        if compute and not any(nodes[d].type is NodeType.COMP_NODE for d in node.deps):
            extra.append(compute[-1] - n)
        if comm and i == comm[0]:
            extra.append(comm[-1] - n)
        out.append(tuple(extra))
    return out


def build_layout(template: StageTemplate, first: bool, id_width: int, hole_width: dict) -> Layout:
    nodes = template.program.nodes
    chunks, slots, dep_offsets, holes, position = [], {k: [] for k in WIDTH}, [], {}, 0
    previous = links(nodes)
    for i, node in enumerate(nodes):
        deps = sorted(set(node.deps) | (set() if first else set(previous[i])))
        segments = [w._key(w._ID, w._VARINT), ("id", i), w._len_field(w._NAME, node.name.encode()),
                    w._key(w._TYPE, w._VARINT) + w.varint(int(node.type))]
        if deps:
            segments.append(w._key(w._DATA_DEPS, w._LEN) + w.varint(len(deps) * id_width))
            segments += [("dep", d) for d in deps]
        if node.type is NodeType.COMP_NODE:
            segments += [w._key(w._DURATION, w._VARINT), ("duration", i), w._NOT_CPU,
                         _slot_attr("num_ops", w._INT64, WIDTH["flops"]), ("flops", i),
                         _slot_attr("tensor_size", w._UINT64, WIDTH["nbytes"]), ("nbytes", i),
                         w._attr("op_type", w._STRING, node.op_type)]
        else:
            segments += [w._NOT_CPU, _slot_attr("comm_size", w._INT64, WIDTH["comm"]), ("comm", i)]
            if node.type is NodeType.COMM_COLL_NODE:
                segments += [w._attr("comm_type", w._INT64, node.collective.value),
                             *w._hole_attr("pg_name", w._STRING, node.group, hole_width[node.group])]
            else:
                segments += [_slot_attr("comm_tag", w._INT32, WIDTH["tag"]), ("tag", i),
                             *w._hole_attr("comm_src", w._INT32, node.src, hole_width[node.src]),
                             *w._hole_attr("comm_dst", w._INT32, node.dst, hole_width[node.dst])]
        size = lambda s: len(s) if isinstance(s, bytes) else (
            id_width if isinstance(s, tuple) and s[0] in ("id", "dep") else WIDTH[s[0]] if isinstance(s, tuple)
            else hole_width[s])
        prefix = w.varint(sum(size(s) for s in segments))
        chunks.append(prefix)
        position += len(prefix)
        for s in segments:
            if isinstance(s, bytes):
                chunks.append(s)
            elif isinstance(s, tuple):
                kind = "id" if s[0] == "dep" else s[0]  # ids and dependencies: first id + offset
                slots[kind].append(position)
                if kind == "id":
                    dep_offsets.append(s[1])
                chunks.append(bytes(size(s)))
            else:
                holes.setdefault(s, []).append(position)
                chunks.append(bytes(hole_width[s]))
            position += size(s)
    body = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return Layout(body, {k: np.asarray(v, dtype=np.int64) for k, v in slots.items()},
                  np.asarray(dep_offsets, dtype=np.int64),
                  tuple((h, np.asarray(p, dtype=np.int64)[:, None] + np.arange(hole_width[h])) for h, p in holes.items()))


def put(body: np.ndarray, starts: np.ndarray, values: np.ndarray, width: int) -> None:
    """`values` as fixed-width varints at `starts`."""
    if not len(starts):
        return
    values = values.astype(np.uint64)
    shifts = (7 * np.arange(width)).astype(np.uint64)
    encoded = ((values[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    encoded[:, :-1] |= 0x80
    if int(values.max()) >> (7 * width):
        raise OverflowError(f"value {int(values.max())} does not fit a {width}-byte varint")
    body[starts[:, None] + np.arange(width)] = encoded


class StageWriter:
    """Streams one rank class's iterations (a stage of a replica, or of all replicas) to its ranks."""

    def __init__(self, template: StageTemplate, edges: int, id_width: int, hole_width: dict):
        self.template, self.edges, self.id_width = template, edges, id_width
        self.layouts = {first: build_layout(template, first, id_width, hole_width) for first in (True, False)}
        self.nodes = len(template.program.nodes)

    def iteration(self, index: int, values: dict) -> Layout:
        layout = self.layouts[index == 0]
        body, slots, base = layout.body, layout.slots, index * self.nodes
        put(body, slots["id"], base + layout.dep_offsets, self.id_width)
        put(body, slots["flops"], np.maximum(values["flops"], 1), WIDTH["flops"])
        put(body, slots["nbytes"], np.maximum(values["nbytes"], 1), WIDTH["nbytes"])
        put(body, slots["duration"], values["duration_us"], WIDTH["duration"])
        put(body, slots["comm"], values["comm_bytes"], WIDTH["comm"])
        tags = np.array([n.tag for n in self.template.program.nodes
                         if n.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)], dtype=np.int64)
        put(body, slots["tag"], tags + index * self.edges, WIDTH["tag"])
        return layout


def stage_stats(template: StageTemplate, values: dict, stats: dict) -> None:
    """Add one iteration's per-rank totals into `stats` (summary.json's rank-class figures)."""
    nodes = template.program.nodes
    stats["flops"] = stats.get("flops", 0) + int(values["flops"].sum())
    stats["compute_bytes"] = stats.get("compute_bytes", 0) + int(values["nbytes"].sum())
    comm_bytes, comm_count = stats.setdefault("comm_bytes", Counter()), stats.setdefault("comm_count", Counter())
    for index, size in zip(template.comm, values["comm_bytes"]):
        node = nodes[index]
        if node.type is NodeType.COMM_COLL_NODE:
            comm_bytes[node.collective.name] += int(size)
            comm_count[node.collective.name] += 1
        else:
            key = "send_bytes" if node.type is NodeType.COMM_SEND_NODE else "recv_bytes"
            stats[key] = stats.get(key, 0) + int(size)
    counted = stats.setdefault("nodes", Counter())
    for node_type, count in template.program.stats.nodes.items():
        counted[node_type] += count


def write_class(folder: Path, writer: StageWriter, iterations, ranks: list[int], hole_values) -> None:
    """`iterations`: per iteration, its values (StageTemplate.values); `hole_values(rank)`: the
    bytes of each hole for `rank`."""
    files = [open(folder / f"workload.{rank}.et", "wb") for rank in ranks]
    try:
        stamps = [hole_values(rank) for rank in ranks]
        for f in files:
            f.write(w.metadata_record())
        for index, values in enumerate(iterations):
            layout = writer.iteration(index, values)
            for f, stamp in zip(files, stamps):
                for hole, positions in layout.holes:
                    layout.body[positions] = np.frombuffer(stamp[hole], dtype=np.uint8)
                f.write(layout.body.tobytes())
    finally:
        for f in files:
            f.close()


def hole_widths(workload, holes) -> dict:
    """Every hole's width: group ids share their width in a set, rank numbers are fixed width."""
    rank = workload.representative(0)
    return {h: len(v) for h, v in workload.hole_values(rank, holes).items()}


__all__ = ["StageWriter", "write_class", "stage_stats", "hole_widths", "GroupHole", "RankHole"]
