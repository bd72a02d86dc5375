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

EMPTY_COMM_BYTES = 4096  # what a step's communication that moves nothing is written as (see StageWriter)
WIDTH = {"id": None, "link": None, "flops": 9, "nbytes": 9, "duration": 5, "comm": 9, "tag": 5}


def _slot_attr(name: str, field: int, width: int) -> bytes:
    head = w._len_field(w._ATTR_NAME, name.encode()) + w._key(field, w._VARINT)
    return w._key(w._ATTR, w._LEN) + w.varint(len(head) + width) + head


@dataclass(frozen=True)
class Layout:
    body: np.ndarray  # uint8, slots zero
    slots: dict  # kind -> positions (start bytes), in node order of that kind
    dep_offsets: np.ndarray  # per id slot (ids, dependencies within the step): value minus the step's first id
    link_to_comm: np.ndarray  # per link slot: 1 if it names the previous last message, 0 the last compute
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
    chunks, slots, dep_offsets, to_comm, holes, position = [], {k: [] for k in WIDTH}, [], [], {}, 0
    previous, n = links(nodes), len(nodes)
    last_compute = max((i for i, x in enumerate(nodes) if x.type is NodeType.COMP_NODE), default=None)
    for i, node in enumerate(nodes):
        deps = sorted(set(node.deps))
        linked = [] if first else sorted({int(offset + n != last_compute) for offset in previous[i]})
        segments = [w._key(w._ID, w._VARINT), ("id", i), w._len_field(w._NAME, node.name.encode()),
                    w._key(w._TYPE, w._VARINT) + w.varint(int(node.type))]
        if deps or linked:  # links first: they name earlier steps' nodes
            segments.append(w._key(w._DATA_DEPS, w._LEN) + w.varint((len(deps) + len(linked)) * id_width))
            segments += [("link", k) for k in linked] + [("dep", d) for d in deps]
        if node.type is NodeType.COMP_NODE:
            segments += [w._key(w._DURATION, w._VARINT), ("duration", i), w._NOT_CPU,
                         _slot_attr("num_ops", w._INT64, WIDTH["flops"]), ("flops", i),
                         _slot_attr("tensor_size", w._UINT64, WIDTH["nbytes"]), ("nbytes", i),
                         w._attr("op_type", w._STRING, node.op_type)]
        else:
            segments += [w._NOT_CPU, _slot_attr("comm_size", w._INT64, WIDTH["comm"]), ("comm", i)]
            if node.type is NodeType.COMM_COLL_NODE:
                segments += [w._attr("comm_type", w._INT64, node.collective.value),
                             w._hole_head("pg_name", w._STRING, hole_width[node.group]), node.group]
            else:
                segments += [_slot_attr("comm_tag", w._INT32, WIDTH["tag"]), ("tag", i),
                             w._hole_head("comm_src", w._INT32, hole_width[node.src]), node.src,
                             w._hole_head("comm_dst", w._INT32, hole_width[node.dst]), node.dst]
        size = lambda s: len(s) if isinstance(s, bytes) else (
            id_width if isinstance(s, tuple) and s[0] in ("id", "dep", "link") else WIDTH[s[0]]
            if isinstance(s, tuple) else hole_width[s])
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
                elif kind == "link":
                    to_comm.append(s[1])
                chunks.append(bytes(size(s)))
            else:
                holes.setdefault(s, []).append(position)
                chunks.append(bytes(hole_width[s]))
            position += size(s)
    body = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return Layout(body, {k: np.asarray(v, dtype=np.int64) for k, v in slots.items()},
                  np.asarray(dep_offsets, dtype=np.int64), np.asarray(to_comm, dtype=bool),
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
    """One template's records for one rank class: a step's layout filled with its numbers."""

    def __init__(self, template: StageTemplate, edges: int, id_width: int, hole_width: dict, counts: bool = True):
        # counts: a step of its own (its tags advance the step count); a draft model's steps do not
        self.template, self.edges, self.id_width, self.counts = template, edges, id_width, counts
        self.layouts = {first: build_layout(template, first, id_width, hole_width) for first in (True, False)}
        nodes = template.program.nodes
        self.nodes = len(nodes)
        self.last_compute = max((i for i, x in enumerate(nodes) if x.type is NodeType.COMP_NODE), default=None)
        self.last_comm = max((i for i, x in enumerate(nodes) if x.type is not NodeType.COMP_NODE), default=None)
        self.tags = np.array([n.tag for n in nodes if n.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)],
                             dtype=np.int64)

    def step(self, cursor: "Cursor", values: dict) -> Layout:
        """The layout of the step that follows what `cursor` has written; advances the cursor."""
        layout = self.layouts[cursor.next_id == 0]
        body, slots, base = layout.body, layout.slots, cursor.next_id
        put(body, slots["id"], base + layout.dep_offsets, self.id_width)
        if len(layout.link_to_comm):
            comm = cursor.last_comm if cursor.last_comm is not None else cursor.last_compute
            put(body, slots["link"], np.where(layout.link_to_comm, comm, cursor.last_compute), self.id_width)
        put(body, slots["flops"], np.maximum(values["flops"], 1), WIDTH["flops"])
        put(body, slots["nbytes"], np.maximum(values["nbytes"], 1), WIDTH["nbytes"])
        put(body, slots["duration"], values["duration_us"], WIDTH["duration"])
        # a step may move nothing (no sampled position to gather, no token to send back). ASTRA-sim
        # hangs on a 0-byte collective and aborts on a 0-byte send, and it splits a collective into
        # preferred-dataset-splits chunks over the group: a 1-byte stand-in leaves the chunks empty
        # and hangs too (measured). 4 KiB is latency-bound on any network: it costs what nothing does.
        comm = values["comm_bytes"]
        put(body, slots["comm"], np.where(comm > 0, comm, EMPTY_COMM_BYTES), WIDTH["comm"])
        put(body, slots["tag"], self.tags + cursor.steps * self.edges, WIDTH["tag"])
        cursor.steps += self.counts
        if self.last_compute is not None:
            cursor.last_compute = base + self.last_compute
        if self.last_comm is not None:
            cursor.last_comm = base + self.last_comm
        cursor.next_id = base + self.nodes
        return layout


@dataclass
class Cursor:
    """Where a rank's stream stands: the next node id, the last compute and message so far, and
    the steps written (a step's send/recv tags are tag + steps x edges)."""

    next_id: int = 0
    last_compute: int | None = None
    last_comm: int | None = None
    steps: int = 0


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


def write_class(folder: Path, steps, ranks: list[int], hole_values) -> None:
    """`steps`: (StageWriter, its values) in the ranks' order; `hole_values(rank)`: the bytes of
    each hole for `rank`."""
    files = [open(folder / f"workload.{rank}.et", "wb") for rank in ranks]
    try:
        stamps = [hole_values(rank) for rank in ranks]
        for f in files:
            f.write(w.metadata_record())
        cursor = Cursor()
        for writer, values in steps:
            layout = writer.step(cursor, values)
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
