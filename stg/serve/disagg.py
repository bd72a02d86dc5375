"""Prefill/decode disaggregation (Splitwise, DistServe, Mooncake): separate prefill and decode
instances, each with its own tp and pp (prefill_tp/prefill_pp, decode_tp/decode_pp, the
plan's tp/pp by default) and the plan's ep, each request's KV cache moved from the one to the
other. Rank numbering and the KV overlaps between the two layouts: stg/serve/instances.py.

Requests go round-robin in arrival order to the prefill instances (and within one to its ep
engines), where they run their prompt and sample their first token (a prefill instance's
requests have output 1); a request with more to generate then goes to decode instance
(request id mod D), to its engines round-robin in arrival order. Its KV cache moves as
SEND/RECV pairs per layer, one per overlapping (prefill rank, decode rank) pair (tag: request
x layers + layer), in the order the prefill scheduler finished the prompts. The sends follow
the prefill iteration that finished the prompt on its rank's message chain; the receives come
before the decode iteration that admits the request, and that iteration waits for them (a
zero-cost compute node joins them). It arrives at the decode instance when the transfer would
end: the prefill iteration's end plus the sends of the busiest prefill rank one after another
under the alpha-beta network. Deadlock-free by construction: a receive waits on a send that
depends only on its prefill instance's own progress, and a prefill instance never waits on a
decode instance; the pre-write replay runs one rank per class and every rank it exchanges
messages with, transitively.

TTFT comes from the prefill instance, the other tokens from the decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from stg.emit import write_trace_set
from stg.errors import PlanError, StgError
from stg.graph import OpKind
from stg.program import ClassStats, GroupHole, NodeType, RankHole, RankProgram, TraceNode
from stg.serve.instances import InstanceSet, KVPeer, Layout
from stg.serve.kvcache import kv_bytes_per_token_per_layer
from stg.serve.records import FILE as ITERATIONS_FILE, write_iterations
from stg.serve.metrics import request_metrics, totals
from stg.serve.run import TAG_LIMIT, Timed, idle_replicas, run_replica
from stg.serve.scheduler import Request
from stg.serve.stream import EMPTY_COMM_BYTES, links
from stg.slice_check import replay_ranks


class DisaggregationError(StgError):
    """The prefill and decode instances' programs would not run to the end together."""


KV_TAG_BASE = 200_000_000  # above every pipeline tag of the set (checked), below ASTRA-sim's limit


@dataclass(frozen=True)
class Transfer:
    request: int
    prompt: int
    source: int  # prefill instance
    source_engine: int
    target: int  # decode instance (index among all instances)
    target_engine: int


@dataclass(frozen=True)
class Side:
    """One kind of instance: its engine, clock, scheduler settings and KV pool."""

    engine: object
    clock: object
    config: object
    kv: object

    @property
    def layout(self) -> Layout:
        plan = self.engine.plan
        return Layout(plan.tp, plan.pp, plan.ep)

    @cached_property
    def _layers(self) -> list[list[int]]:
        return [[op.layer for op in self.engine.stage_ops(stage) if op.kind is OpKind.ATTENTION]
                for stage in range(self.engine.plan.pp)]

    def layers(self, stage: int) -> list[int]:
        """The attention layers (graph layer numbers) of `stage`, in order."""
        return self._layers[stage]


def _program(engine, stage: int, timed: list[Timed], sends: dict, recvs: dict, messages) -> RankProgram:
    """One instance's rank of `stage`: its iterations linked as stream.py links them, the KV
    receives (and a joining node) before iteration i for recvs[i], the sends after it for
    sends[i]; messages(transfer) gives each transfer's (layer position, peer hole, bytes)."""
    template = engine.template(stage)
    previous = links(template.program.nodes)
    n, last_compute = len(template.program.nodes), max(template.compute)
    slot = {int(i): ("c", j) for j, i in enumerate(template.compute)} | {int(i): ("m", j) for j, i in enumerate(template.comm)}
    messages_at = {i for i, node in enumerate(template.program.nodes)
                   if node.type in (NodeType.COMM_SEND_NODE, NodeType.COMM_RECV_NODE)}
    nodes: list[TraceNode] = []
    last = {"compute": None, "comm": None}

    def add(**fields) -> int:
        nodes.append(TraceNode(id=len(nodes), **fields))
        return len(nodes) - 1

    def kv(kind: NodeType, transfer: Transfer, layer: int, peer, size: int) -> int:
        deps = {d for d in (last["compute"], last["comm"] if kind is NodeType.COMM_SEND_NODE else None) if d is not None}
        src, dst = (RankHole(), peer) if kind is NodeType.COMM_SEND_NODE else (peer, RankHole())
        return add(name=f"kv r{transfer.request} layer {layer}", type=kind, deps=tuple(sorted(deps)),
                   comm_bytes=size, src=src, dst=dst, tag=KV_TAG_BASE + transfer.request * messages.layers + layer)

    for index, t in enumerate(timed):
        arrived = [kv(NodeType.COMM_RECV_NODE, tr, *message)
                   for tr in recvs.get(index, ()) for message in messages(tr)]
        if arrived:  # the iteration that admits these requests waits for their caches
            deps = tuple(sorted(set(arrived) | ({last["compute"]} if last["compute"] is not None else set())))
            last["compute"] = add(name=f"kv arrived i{index}", type=NodeType.COMP_NODE, deps=deps, op_type="kv_join")
        base = len(nodes)
        values = template.values(t.shape, engine.device)
        flops, nbytes, durations, sizes = (values[k].tolist() for k in ("flops", "nbytes", "duration_us", "comm_bytes"))
        for i, node in enumerate(template.program.nodes):  # one replace a node: the step's numbers, ids, links
            deps = {d + base for d in node.deps}
            for offset in previous[i] if index or arrived else ():
                target = last["compute"] if offset + n == last_compute else last["comm"]
                if target is not None:
                    deps.add(target)
            kind, j = slot[i]
            # communication that moves nothing: 4 KiB, as stream.py writes it (ASTRA-sim hangs on 0 bytes)
            numbers = dict(flops=flops[j], nbytes=nbytes[j], duration_us=durations[j]) if kind == "c" else \
                dict(comm_bytes=sizes[j] or EMPTY_COMM_BYTES)
            nodes.append(replace(node, id=len(nodes), deps=tuple(sorted(deps)),
                                 tag=node.tag + index * engine.edges if i in messages_at else 0, **numbers))
        for node in nodes[base:]:
            last["compute" if node.type is NodeType.COMP_NODE else "comm"] = node.id
        for tr in sends.get(index, ()):
            for message in messages(tr):
                last["comm"] = kv(NodeType.COMM_SEND_NODE, tr, *message)
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


class Messages:
    """A class's KV messages of one transfer: per layer of its stage and per overlap partner j,
    (layer position, KVPeer, prompt x units_j x bytes per unit and token)."""

    def __init__(self, instances: InstanceSet, cls: int, own: Side, other: Side, layer_index: dict, unit_bytes: int):
        k, stage, _, _ = instances.classes[cls]
        self.prefill = instances.kinds[k] == "prefill"
        self.layers = len(layer_index)
        self.units, self.unit_bytes = instances.signature(cls), unit_bytes
        where = {layer: s for s in range(other.layout.pp) for layer in other.layers(s)}
        self.plan = [(layer_index[layer], where[layer]) for layer in own.layers(stage)]

    def __call__(self, tr: Transfer):
        instance, engine = (tr.target, tr.target_engine) if self.prefill else (tr.source, tr.source_engine)
        return [(position, KVPeer(instance, stage, engine, j), tr.prompt * units * self.unit_bytes)
                for position, stage in self.plan for j, units in enumerate(self.units)]


def _unit_bytes(model, plan) -> tuple[int | None, int]:
    """(KV heads, or None for MLA's latent; bytes per token, layer and unit: a KV head or the latent)."""
    per_layer = kv_bytes_per_token_per_layer(model.config, plan.kv_cache_dtype)
    if getattr(model.config, "attention", "gqa") == "mla":
        return None, per_layer
    heads = model.config.kv_heads_count
    return heads, per_layer // heads


def check_layouts(model, plan) -> None:
    """Each kind's tp must split the KV heads (MLA: the latent is whole on every rank)."""
    if getattr(model.config, "attention", "gqa") == "mla":
        return
    heads = model.config.kv_heads_count
    for name in ("prefill_tp", "decode_tp"):
        tp = getattr(plan, name) or plan.tp
        if heads % tp:
            raise PlanError(f"{name}: {tp} does not divide model {model.name}'s {heads} KV heads")


def _schedule(plan, requests, prefill: Side, decode: Side, transfer_s):
    """Both kinds' iterations; per (instance, engine) the sends after, the receives before, each iteration."""
    P, D, ep = plan.prefill_instances, plan.decode_instances, plan.ep
    attention = plan.attention_flops
    shares = [requests[p::P] for p in range(P)]
    prefill_timed = [run_replica([Request(r.id, r.arrival_s, r.prompt, 1) for r in share], prefill.config,
                                 prefill.clock, attention, ep) for share in shares]
    by_id = {r.id: (r, p, i % ep) for p, share in enumerate(shares) for i, r in enumerate(share)}
    sends: dict = {}
    arrivals: list[list[tuple[Request, int, int]]] = [[] for _ in range(D)]
    for p, timed in enumerate(prefill_timed):
        for index, t in enumerate(timed):
            for e, iteration in enumerate(t.engines):
                for rid in iteration.finished:
                    r, _, _ = by_id[rid]
                    if r.output > 1:
                        sends.setdefault((p, e), {}).setdefault(index, []).append(rid)
                        arrivals[rid % D].append((Request(rid, t.end_s + transfer_s(r.prompt), r.prompt, r.output,
                                                          prefilled=True), p, e))
    decode_timed, recvs, transfers = [], {}, {}
    for d in range(D):
        mine = sorted(arrivals[d], key=lambda a: (a[0].arrival_s, a[0].id))
        for i, (r, p, e) in enumerate(mine):
            transfers[r.id] = Transfer(r.id, r.prompt, p, e, P + d, i % ep)
        timed = run_replica([a[0] for a in mine], decode.config, decode.clock, attention, ep)
        seen = set()
        for index, t in enumerate(timed):
            for e, iteration in enumerate(t.engines):
                for slot in iteration.slots:
                    if slot.request not in seen:
                        seen.add(slot.request)
                        recvs.setdefault((P + d, e), {}).setdefault(index, []).append(transfers[slot.request])
        decode_timed.append(timed)
    sends = {key: {i: [transfers[rid] for rid in rids] for i, rids in per.items()} for key, per in sends.items()}
    idle_replicas(prefill_timed, "prefill_instances", P)
    idle_replicas(decode_timed, "decode_instances", D)
    return prefill_timed + decode_timed, sends, recvs


def run_disaggregated(model, plan, prefill: Side, decode: Side, requests: list[Request], out: Path, summary: dict,
                      slo_ttft_s, slo_tpot_s) -> dict:
    P, D = plan.prefill_instances, plan.decode_instances
    kv_heads, unit_bytes = _unit_bytes(model, plan)
    sides = [prefill] * P + [decode] * D
    instances = InstanceSet([s.layout for s in sides], ["prefill"] * P + ["decode"] * D, kv_heads)
    summary["world_size"] = instances.size
    layer_index = {layer: i for i, layer in enumerate(sorted(l for s in range(decode.layout.pp) for l in decode.layers(s)))}
    send_us = prefill.clock.comm.send_us

    layers = {len(prefill.layers(stage)) for stage in range(prefill.layout.pp)}

    def transfer_s(prompt: int) -> float:
        """The busiest prefill rank's sends of one request, one after another."""
        return max(n * sum(send_us(prompt * u * unit_bytes) for u in signature)
                   for n in layers for signature in instances.variants[0]) / 1e6

    timed, sends, recvs = _schedule(plan, requests, prefill, decode, transfer_s)
    edges = max(prefill.engine.edges, decode.engine.edges, 1)
    if max(len(t) for t in timed) * edges >= KV_TAG_BASE or KV_TAG_BASE + len(requests) * len(layer_index) >= TAG_LIMIT:
        raise PlanError(f"requests: {len(requests)} are too many for unique send/recv tags below {TAG_LIMIT:,}")
    programs = []
    for cls, (k, stage, e, _) in enumerate(instances.classes):
        own, other = (prefill, decode) if k < P else (decode, prefill)
        messages = Messages(instances, cls, own, other, layer_index, unit_bytes)
        programs.append(_program(own.engine, stage, timed[k], sends.get((k, e), {}) if k < P else {},
                                 recvs.get((k, e), {}) if k >= P else {}, messages))
    instances.programs = tuple(programs)
    ranks = _replay_set(instances)
    problems = replay_ranks(instances, ranks)
    if problems:
        raise DisaggregationError(f"the disaggregated programs would not run to the end, nothing written: {problems[0].reason}")
    rows = request_metrics(requests, [t for run in timed for t in run])
    makespan = max((run[-1].end_s for run in timed if run), default=0.0)
    summary["instances"] = [{**entry, "iterations": None} for entry in instances.describe()]
    summary["iterations_file"] = ITERATIONS_FILE
    summary["kv_transfers"] = [{"request": tr.request, "from": tr.source, "to": tr.target, "prompt": tr.prompt,
                                "bytes": tr.prompt * len(layer_index) * (unit_bytes * kv_heads if kv_heads else
                                                                        unit_bytes * decode.layout.tp)}
                               for key in sorted(sends) for index in sorted(sends[key]) for tr in sends[key][index]]
    summary["requests"] = rows
    summary["totals"] = totals(rows, makespan, slo_ttft_s, slo_tpot_s)
    summary["rank_classes"] = [{"class": c, "instance": k, "kind": instances.kinds[k], "stage": s, "engine": e,
                                "tp_ranks": [a for a, w in enumerate(instances.variant_of[k]) if w == v],
                                "count": instances.class_count(c), **p.stats.to_dict()}
                               for c, ((k, s, e, v), p) in enumerate(zip(instances.classes, programs))]
    summary["rank_class"] = [instances.class_of(r) for r in range(instances.size)]
    logs = []

    def records(folder: Path) -> None:
        logs.extend(write_iterations(folder, out, timed, "instance"))
        for entry, log in zip(summary["instances"], logs):
            entry["iterations"] = log.reference()

    write_trace_set(Path(out), instances, summary, before_summary=records)
    for entry, log in zip(summary["instances"], logs):
        entry["iterations"] = log
    return summary


def _replay_set(instances: InstanceSet) -> list[int]:
    """One rank per class, and every rank these exchange messages with, transitively."""
    ranks = [instances.representative(c) for c in range(len(instances.classes))]
    seen = set(ranks)
    for rank in ranks:  # grows while it runs
        for hole in instances.programs[instances.class_of(rank)].holes:
            if not isinstance(hole, GroupHole):
                peer = instances.peer(rank, hole)
                if peer not in seen:
                    seen.add(peer)
                    ranks.append(peer)
    return ranks
