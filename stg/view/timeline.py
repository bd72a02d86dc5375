"""A trace set's timed replay as a timeline: every node of the chosen ranks with its start and
end, and the Chrome trace event JSON that Perfetto (ui.perfetto.dev) and chrome://tracing open.

All ranks are replayed (a rank's times depend on its peers); only the chosen ones are kept.
Per rank (one process): a compute track (COMP nodes; one runs at a time), a communication
track (collectives and sends; they hold the rank's one comm slot) and receive tracks (a RECV
holds nothing, so posted receives overlap: each takes the first free lane). A collective's
slice runs from its rank joining to its end (waiting for the last member included), a
receive's from its posting to its message's arrival. Flow arrows join each send to the
receive that took its message; instant markers show where each micro-batch action (`3F0`,
`3B0`, `3W0`, the action label that starts stg's node names) and the optimizer step begin.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from stg.chakra import et_def_pb2 as pb
from stg.chakra.reader import iter_nodes, node_attrs
from stg.chakra.rank_graph import coll_name
from stg.chakra.replay import CommModel, Timing
from stg.chakra.validate import timed_replay
from stg.errors import OutputError, ViewError
from stg.view.traceset import TraceSet

_ACTION = re.compile(r"(\d+[FBW]\d+|S)(?= )")  # the label stg puts first in a node's name


class SliceKind(Enum):
    """What a slice is; the value is its Chrome trace category."""

    COMPUTE = "compute"
    COLLECTIVE = "collective"
    SEND = "send"
    RECV = "recv"


_KIND = {pb.COMP_NODE: SliceKind.COMPUTE, pb.COMM_COLL_NODE: SliceKind.COLLECTIVE,
         pb.COMM_SEND_NODE: SliceKind.SEND, pb.COMM_RECV_NODE: SliceKind.RECV}
COMPUTE_TID, COMM_TID, RECV_TID = 1, 2, 3  # receive lanes are 3, 4, ...


@dataclass(frozen=True)
class Slice:
    """One node's run on one rank, in µs."""

    node_id: int
    name: str
    kind: SliceKind
    start_us: float
    end_us: float
    action: str  # `3F0`, `S` (optimizer step) or "" (no action label)
    args: dict  # flops, bytes, collective type, group, mesh axes, peer, tag

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass(frozen=True)
class Timeline:
    """The timed replay of a set, kept for ``ranks``; ``flows`` link (rank, node id) of a send to
    (rank, node id) of its receive, where both ranks are kept."""

    comm: CommModel
    timing: Timing
    ranks: tuple[int, ...]
    labels: dict[int, str]  # rank -> `rank 4 (class 1: pp=1)`
    stages: dict[int, int]  # rank -> pipeline stage
    slices: dict[int, tuple[Slice, ...]]  # by rank, in node-id order
    flows: tuple[tuple[int, int, int, int], ...]

    @property
    def makespan_us(self) -> float:
        return self.timing.makespan_us

    def busy_us(self, rank: int) -> float:
        return sum(s.duration_us for s in self.slices[rank] if s.kind is SliceKind.COMPUTE)


def record_timeline(out: str | Path, *, comm: CommModel | str = CommModel.FREE, ranks: list[int] | None = None,
                    alpha_us: float = 5.0, bandwidth_gbps: float = 50.0) -> Timeline:
    """Replay ``out`` with time (see ``timed_replay``) and keep every node of ``ranks`` (default:
    the first rank of each rank class)."""
    trace_set = TraceSet.open(out)
    chosen = sorted(set(ranks)) if ranks is not None else trace_set.representatives()
    bad = [r for r in chosen if not 0 <= r < trace_set.world_size]
    if bad or not chosen:
        raise ViewError(f"ranks: {bad or 'none'} not in 0..{trace_set.world_size - 1}")
    try:
        timing = timed_replay(out, comm=comm, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps, record=chosen)
    except ValueError as error:
        raise ViewError(str(error)) from None
    times = timing.nodes
    assert times is not None
    slices = {r: _slices(trace_set, r, times.ids[r], times.start_us[r], times.end_us[r]) for r in chosen}
    kept = set(chosen)
    flows = tuple((sr, times.ids[sr][si], dr, times.ids[dr][di]) for sr, si, dr, di in times.messages
                  if sr in kept and dr in kept)
    return Timeline(comm=CommModel(comm), timing=timing, ranks=tuple(chosen),
                    labels={r: trace_set.label(r) for r in chosen}, stages={r: trace_set.stage(r) for r in chosen},
                    slices=slices, flows=flows)


def _slices(trace_set: TraceSet, rank: int, ids, starts, ends) -> tuple[Slice, ...]:
    index = {nid: i for i, nid in enumerate(ids)}
    found = []
    for node in iter_nodes(trace_set.out / f"workload.{rank}.et"):
        i = index[node.id]
        action = _ACTION.match(node.name)
        found.append(Slice(node.id, node.name, _KIND[node.type], starts[i], ends[i],
                           action[1] if action else "", _args(trace_set, rank, node)))
    found.sort(key=lambda s: s.node_id)
    return tuple(found)


def _args(trace_set: TraceSet, rank: int, node: pb.Node) -> dict:
    attrs = node_attrs(node)
    args: dict = {"node_id": node.id}
    if node.type == pb.COMP_NODE:
        args.update(flops=attrs["num_ops"], bytes=attrs["tensor_size"], op=attrs.get("op_type", ""))
    elif node.type == pb.COMM_COLL_NODE:
        group = trace_set.group_of(attrs.get("pg_name", ""))
        args.update(comm_type=coll_name(attrs["comm_type"]), bytes=attrs["comm_size"], group=group,
                    group_size=len(trace_set.members(group)), axes=trace_set.group_axes(group))
    else:
        src, dst = attrs["comm_src"], attrs["comm_dst"]
        args.update(peer=dst if node.type == pb.COMM_SEND_NODE else src, tag=attrs["comm_tag"],
                    bytes=attrs["comm_size"], axes=trace_set.axes_of((src, dst)))
    return args


# --- Chrome trace event JSON ----------------------------------------------------------------


def _us(t: float) -> float:
    return round(t, 3)  # ns resolution: what Perfetto keeps


def _receive_lanes(slices: tuple[Slice, ...]) -> dict[int, int]:
    """Node id -> tid for receives: each takes the lowest lane free at its start."""
    lanes: list[float] = []  # end time per lane
    tid = {}
    for s in sorted((s for s in slices if s.kind is SliceKind.RECV), key=lambda s: (s.start_us, s.node_id)):
        lane = next((k for k, end in enumerate(lanes) if end <= s.start_us), len(lanes))
        if lane == len(lanes):
            lanes.append(s.end_us)
        lanes[lane] = s.end_us
        tid[s.node_id] = RECV_TID + lane
    return tid


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline as a Chrome trace event object ({"traceEvents": [...]}); ts and dur in µs."""
    flow_out = {(sr, sid): k for k, (sr, sid, _, _) in enumerate(timeline.flows, start=1)}
    flow_in = {(dr, did): k for k, (_, _, dr, did) in enumerate(timeline.flows, start=1)}
    events: list[dict] = []
    for rank in timeline.ranks:
        slices = timeline.slices[rank]
        recv_tid = _receive_lanes(slices)
        lanes = sorted(set(recv_tid.values()))
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": timeline.labels[rank]}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for tid, name in [(COMPUTE_TID, "compute"), (COMM_TID, "communication"),
                          *((t, f"receive {t - RECV_TID}") for t in lanes)]:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
        for s in slices:
            tid = (COMPUTE_TID if s.kind is SliceKind.COMPUTE else recv_tid[s.node_id] if s.kind is SliceKind.RECV
                   else COMM_TID)
            start = _us(s.start_us)  # dur from the rounded ends, so consecutive slices never overlap
            event = {"name": s.name, "cat": s.kind.value, "ph": "X", "ts": start,
                     "dur": _us(_us(s.end_us) - start), "pid": rank, "tid": tid, "args": s.args}
            if (rank, s.node_id) in flow_out:
                event.update(bind_id=f"0x{flow_out[rank, s.node_id]:x}", flow_out=True)
            if (rank, s.node_id) in flow_in:
                event.update(bind_id=f"0x{flow_in[rank, s.node_id]:x}", flow_in=True)
            events.append(event)
        events.extend(_markers(rank, slices, timeline.timing.finish_us[rank]))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "stg timeline", "comm": timeline.comm.value,
                          "makespan_us": timeline.makespan_us}}


def _markers(rank: int, slices: tuple[Slice, ...], finish_us: float) -> list[dict]:
    """An instant event where each action's first compute node starts, and at the step's end."""
    first: dict[str, float] = {}
    for s in slices:
        if s.kind is SliceKind.COMPUTE and s.action:
            first[s.action] = min(first.get(s.action, s.start_us), s.start_us)
    marks = [{"name": "optimizer step" if action == "S" else action, "cat": "marker", "ph": "i", "s": "t",
              "ts": _us(t), "pid": rank, "tid": COMPUTE_TID,
              "args": {"boundary": "step" if action == "S" else "micro-batch"}}
             for action, t in sorted(first.items(), key=lambda kv: (kv[1], kv[0]))]
    marks.append({"name": "step end", "cat": "marker", "ph": "i", "s": "t", "ts": _us(finish_us), "pid": rank,
                  "tid": COMPUTE_TID, "args": {"boundary": "step"}})
    return marks


def write_timeline(out: str | Path, path: str | Path, *, comm: CommModel | str = CommModel.FREE,
                   ranks: list[int] | None = None, alpha_us: float = 5.0,
                   bandwidth_gbps: float = 50.0) -> Timeline:
    """Write the Chrome trace JSON of ``out``'s timed replay to ``path`` (one event a line; all or
    nothing) and return the timeline."""
    timeline = record_timeline(out, comm=comm, ranks=ranks, alpha_us=alpha_us, bandwidth_gbps=bandwidth_gbps)
    trace = chrome_trace(timeline)
    lines = ",\n".join(json.dumps(e, separators=(",", ":")) for e in trace["traceEvents"])
    rest = json.dumps({k: v for k, v in trace.items() if k != "traceEvents"}, separators=(",", ":"))[1:]
    write_text_atomically(Path(path), '{"traceEvents":[\n' + lines + "\n]," + rest + "\n")
    return timeline


def write_text_atomically(path: Path, text: str) -> None:
    write_bytes_atomically(path, text.encode())


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path`` and rename it into place: no half-written file."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the file private
        os.replace(tmp, path)
    except OSError as error:
        raise OutputError(f"output: cannot write {path}: {error.strerror or error}") from None
