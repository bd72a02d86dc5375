"""Prefill/decode disaggregation (Splitwise, DistServe, Mooncake): separate prefill and decode
instances, each request's KV cache moved from the one to the other.

Instances are the mesh's dp coordinates: prefill instances 0..P-1, then decode instances
P..P+D-1, all with the plan's tp and pp (one engine; rank order tp fastest, then instances,
then pp). Requests go round-robin in arrival order to the prefill instances, where they run
their prompt and sample their first token (a prefill instance's requests have output 1); a
request with more to generate then goes to decode instance (request id mod D). Its KV cache
moves as one SEND/RECV pair per layer between the ranks with the same tp and pp coordinates,
each sized prompt x the rank's KV bytes per token per layer, in the order the prefill
scheduler finished the prompts. The sends follow the prefill iteration that finished the
prompt on its rank's message chain; the receives come before the decode iteration that admits
the request, and that iteration waits for them (a zero-cost compute node joins them). It
arrives at the decode instance when the transfer would end: the prefill iteration's end plus
the sends under the alpha-beta network. Deadlock-free by construction: a receive waits on a
send that depends only on its prefill instance's own progress, and a prefill instance never
waits on a decode instance; the pre-write replay checks one rank per instance and stage.

TTFT comes from the prefill instance, the other tokens from the decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from stg.api import Workload
from stg.emit import write_trace_set
from stg.errors import PlanError, StgError
from stg.graph import OpKind
from stg.plan import Plan
from stg.program import ClassStats, NodeType, RankHole, RankProgram, TraceNode
from stg.serve.run import (TAG_LIMIT, Clock, Timed, idle_replicas, request_metrics, run_replica, scheduler_config,
                           totals)
from stg.serve.scheduler import Request
from stg.serve.stream import links
from stg.slice_check import replay_ranks

class DisaggregationError(StgError):
    """The prefill and decode instances' programs would not run to the end together."""


KV_TAG_BASE = 200_000_000  # above every pipeline tag of the set (checked), below ASTRA-sim's limit


@dataclass(frozen=True)
class PeerHole:
    """The rank with this rank's coordinates in serving instance `instance` (the dp axis)."""

    instance: int

    def __str__(self) -> str:
        return f"instance{self.instance}"


class InstancesWorkload(Workload):
    """A Workload whose point-to-point peers may be other instances' ranks."""

    def peer(self, rank: int, hole) -> int:
        if isinstance(hole, PeerHole):
            stride = self.mesh.stride("dp")
            return rank + (hole.instance - (rank // stride) % self.mesh.sizes["dp"]) * stride
        return super().peer(rank, hole)


@dataclass(frozen=True)
class Transfer:
    request: int
    prompt: int
    source: int  # prefill instance
    target: int  # decode instance (index among all instances)


def _stage_layers(engine, stage: int) -> int:
    return sum(op.kind is OpKind.ATTENTION for op in engine.stage_ops(stage))


def _materialize(template, values) -> list[TraceNode]:
    """The template's nodes with one step's numbers."""
    nodes = list(template.program.nodes)
    for j, i in enumerate(template.compute):
        nodes[i] = replace(nodes[i], flops=int(values["flops"][j]), nbytes=int(values["nbytes"][j]),
                           duration_us=int(values["duration_us"][j]))
    for j, i in enumerate(template.comm):
        nodes[i] = replace(nodes[i], comm_bytes=int(values["comm_bytes"][j]))
    return nodes


def _program(engine, stage: int, timed: list[Timed], sends: dict, recvs: dict) -> RankProgram:
    """One instance's rank of `stage`: its iterations linked as stream.py links them, the KV
    receives (and a joining node) before iteration i for recvs[i], the sends after it for sends[i]."""
    template = engine.template(stage)
    layers, per_token = _stage_layers(engine, stage), engine.kv_bytes_per_token(stage)
    previous = links(template.program.nodes)
    n = len(template.program.nodes)
    nodes: list[TraceNode] = []
    last = {"compute": None, "comm": None}

    def add(**fields) -> int:
        nodes.append(TraceNode(id=len(nodes), **fields))
        return len(nodes) - 1

    def kv(kind: NodeType, transfer: Transfer, layer: int, peer) -> int:
        deps = {d for d in (last["compute"], last["comm"] if kind is NodeType.COMM_SEND_NODE else None) if d is not None}
        src, dst = (RankHole(), peer) if kind is NodeType.COMM_SEND_NODE else (peer, RankHole())
        return add(name=f"kv r{transfer.request} layer {layer}", type=kind, deps=tuple(sorted(deps)),
                   comm_bytes=transfer.prompt * per_token // layers, src=src, dst=dst,
                   tag=KV_TAG_BASE + transfer.request * layers + layer)

    for index, t in enumerate(timed):
        arrived = [kv(NodeType.COMM_RECV_NODE, tr, layer, PeerHole(tr.source))
                   for tr in recvs.get(index, ()) for layer in range(layers)]
        if arrived:  # the iteration that admits these requests waits for their caches
            deps = tuple(sorted(set(arrived) | ({last["compute"]} if last["compute"] is not None else set())))
            last["compute"] = add(name=f"kv arrived i{index}", type=NodeType.COMP_NODE, deps=deps, op_type="kv_join")
        base = len(nodes)
        for i, node in enumerate(_materialize(template, template.values(t.shape, engine.device))):
            deps = {d + base for d in node.deps}
            for offset in previous[i] if index or arrived else ():
                target = last["compute"] if offset + n == max(template.compute) else last["comm"]
                if target is not None:
                    deps.add(target)
            message = node.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)
            nodes.append(replace(node, id=len(nodes), deps=tuple(sorted(deps)),
                                 tag=node.tag + index * engine.edges if message else 0))
        for node in nodes[base:]:
            last["compute" if node.type is NodeType.COMP_NODE else "comm"] = node.id
        for tr in sends.get(index, ()):
            for layer in range(layers):
                last["comm"] = kv(NodeType.COMM_SEND_NODE, tr, layer, PeerHole(tr.target))
    stats = ClassStats()
    for node in nodes:
        stats.nodes[node.type.name] += 1
        if node.type is NodeType.COMP_NODE:
            stats.flops_by_phase["F"] += node.flops
            stats.compute_bytes += node.nbytes
        elif node.type is NodeType.COMM_COLL_NODE:
            stats.comm_bytes[node.collective.name] += node.comm_bytes
            stats.comm_count[node.collective.name] += 1
        elif node.type is NodeType.COMM_SEND_NODE:
            stats.send_bytes += node.comm_bytes
        else:
            stats.recv_bytes += node.comm_bytes
    return RankProgram((stage,), tuple(nodes), stats)


def run_disaggregated(model, plan, engine, kv, requests: list[Request], out: Path, summary: dict,
                      slo_ttft_s, slo_tpot_s) -> dict:
    prefill, decode = plan.prefill_instances, plan.decode_instances
    clock = Clock(engine)
    config = scheduler_config(plan, kv)
    prefill_timed = [run_replica([Request(r.id, r.arrival_s, r.prompt, 1) for r in requests[p::prefill]], config,
                                 clock, plan.attention_flops) for p in range(prefill)]
    by_id = {r.id: r for r in requests}
    # transfer time on the slowest stage: its layers' sends one after another
    transfer_s = lambda prompt: max(
        _stage_layers(engine, s) * clock.comm.send_us(prompt * engine.kv_bytes_per_token(s) // _stage_layers(engine, s))
        for s in range(plan.pp)) / 1e6
    sends: list[dict] = [{} for _ in range(prefill)]
    arrivals: list[list[tuple[Request, Transfer]]] = [[] for _ in range(decode)]
    for p, timed in enumerate(prefill_timed):
        for index, t in enumerate(timed):
            for rid in t.iteration.finished:
                r = by_id[rid]
                if r.output > 1:
                    tr = Transfer(rid, r.prompt, p, prefill + rid % decode)
                    sends[p].setdefault(index, []).append(tr)
                    arrivals[rid % decode].append((Request(rid, t.end_s + transfer_s(r.prompt), r.prompt, r.output,
                                                           prefilled=True), tr))
    decode_timed, recvs = [], []
    for d in range(decode):
        mine = sorted(arrivals[d], key=lambda a: (a[0].arrival_s, a[0].id))
        timed = run_replica([a[0] for a in mine], config, clock, plan.attention_flops)
        transfer = {a[0].id: a[1] for a in mine}
        first, seen = {}, set()
        for index, t in enumerate(timed):
            for slot in t.iteration.slots:
                if slot.request not in seen:
                    seen.add(slot.request)
                    first.setdefault(index, []).append(transfer[slot.request])
        decode_timed.append(timed)
        recvs.append(first)
    idle_replicas(prefill_timed, "prefill_instances", prefill)
    idle_replicas(decode_timed, "decode_instances", decode)
    instances = prefill_timed + decode_timed
    if max(len(t) for t in instances) * max(engine.edges, 1) >= KV_TAG_BASE or \
            KV_TAG_BASE + len(requests) * max(engine.model.layers, 1) >= TAG_LIMIT:
        raise PlanError(f"requests: {len(requests)} are too many for unique send/recv tags below {TAG_LIMIT:,}")
    programs = [_program(engine, stage, timed, sends[k] if k < prefill else {}, recvs[k - prefill] if k >= prefill else {})
                for stage in range(plan.pp) for k, timed in enumerate(instances)]
    parallel = Plan(tp=plan.tp, pp=plan.pp, dp=prefill + decode, sp=False, device=plan.device, schedule="gpipe")
    workload = InstancesWorkload(model, parallel, parallel.mesh(), engine.sharded, tuple(programs), (), {}, ("dp",),
                                 tuple(range(prefill + decode)))
    stride = workload.mesh.stride("pp")
    ranks = [workload.representative(k) + stage * stride for stage in range(plan.pp) for k in range(prefill + decode)]
    problems = replay_ranks(workload, ranks)
    if problems:
        raise DisaggregationError(f"the disaggregated programs would not run to the end, nothing written: {problems[0].reason}")
    rows = request_metrics(requests, [t for timed in instances for t in timed])
    makespan = max((timed[-1].end_s for timed in instances if timed), default=0.0)
    summary["instances"] = [{"instance": k, "kind": "prefill" if k < prefill else "decode",
                             "iterations": [t.to_dict() for t in timed]} for k, timed in enumerate(instances)]
    summary["kv_transfers"] = [{"request": tr.request, "from": tr.source, "to": tr.target, "prompt": tr.prompt}
                               for p in range(prefill) for index in sorted(sends[p]) for tr in sends[p][index]]
    summary["requests"] = rows
    summary["totals"] = totals(rows, makespan, slo_ttft_s, slo_tpot_s)
    summary["rank_classes"] = [{"class": c, "stage": c // (prefill + decode), "instance": c % (prefill + decode),
                                "count": workload.class_count(c), **p.stats.to_dict()} for c, p in enumerate(programs)]
    summary["rank_class"] = [workload.class_of(r) for r in range(workload.mesh.size)]
    write_trace_set(Path(out), workload, summary)
    return summary
