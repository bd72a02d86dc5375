"""The ranks of a disaggregated set: prefill and decode instances, each with its own layout.

Rank numbering: every instance is a contiguous block of ranks, the prefill instances first
(0..P-1), then the decode instances (P..P+D-1). Inside an instance of tp x ep x pp ranks the
order is the serving engine's own: tp fastest, then ep, then pp, so the rank of (tp a, ep
engine e, stage s) in instance k is

    base(k) + s * tp * ep + e * tp + a,    base(k) = sum of the sizes of instances 0..k-1.

summary.json's "instances" lists each instance's kind, tp, pp, ep and first rank.

KV overlaps. A request's KV cache of layer l lives on the prefill instance's stage that holds
l, split over its tp ranks by KV heads (rank a holds heads [a K/tp, (a+1) K/tp) of the K), and
must reach the decode instance's stage that holds l, split by its own tp. Each (prefill rank,
decode rank) pair whose head ranges overlap exchanges one SEND/RECV per request and layer,
sized prompt x overlap heads x head_dim x 2 (K and V) x dtype bytes; every head thus moves
exactly once. Multi-head latent attention caches one latent per token that every tp rank holds
whole, so each decode rank b takes it from one prefill rank, a = b mod prefill tp (the sources
spread over the prefill ranks), sized prompt x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.

Peers are holes resolved by arithmetic per rank (KVPeer: instance, stage, engine and the
index j of the partner in this rank's overlap list); ranks of one instance, stage and engine
share a program when their overlap lists have the same sizes (a "variant": one for even
splits, as tp 4 -> tp 2), so the classes stay few. Communicator groups are each instance's
own mesh's, their ids offset per instance by a multiple of 500 (stg/groups.py's residues kept).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

from stg.chakra.writer import fixed_varint, rank_width
from stg.groups import MODULUS, GroupIds
from stg.plan import Plan
from stg.program import GroupHole


@dataclass(frozen=True)
class KVPeer:
    """This rank's j-th KV partner in instance `instance`: its stage `stage`, ep engine `engine`."""

    instance: int
    stage: int
    engine: int
    j: int

    def __str__(self) -> str:
        return f"kv{self.instance}.{self.stage}.{self.engine}.{self.j}"


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int

    @property
    def size(self) -> int:
        return self.tp * self.ep * self.pp

    def mesh(self):
        return Plan(tp=self.tp, pp=self.pp, ep=self.ep, dp=self.ep, etp=self.tp, sp=False, schedule="gpipe").mesh()


def partners(own: int, own_tp: int, other_tp: int, kv_heads: int | None, prefill_side: bool) -> tuple[tuple[int, int], ...]:
    """(other tp coordinate, overlap units) of tp rank `own`: units are KV heads (GQA), or 1
    for the whole latent (MLA, kv_heads None: decode rank b takes it from prefill rank b mod
    prefill tp)."""
    if kv_heads is None:
        if prefill_side:
            return tuple((b, 1) for b in range(own, other_tp, own_tp))
        return ((own % other_tp, 1),)
    mine, theirs = kv_heads // own_tp, kv_heads // other_tp
    lo, hi = own * mine, (own + 1) * mine
    return tuple((b, min(hi, (b + 1) * theirs) - max(lo, b * theirs))
                 for b in range(lo // theirs, (hi - 1) // theirs + 1))


class InstanceSet:
    """The Workload interface that writing and the pre-write replay use (programs, class_of,
    representative, class_count, hole_values, peer, group_ids, mesh.size), over instances."""

    def __init__(self, layouts: list[Layout], kinds: list[str], kv_heads: int | None):
        self.layouts, self.kinds, self.kv_heads = layouts, kinds, kv_heads
        self.bases = [0]
        for layout in layouts:
            self.bases.append(self.bases[-1] + layout.size)
        self.size = self.bases[-1]
        self.programs: tuple = ()  # per class, in `classes` order (set by the caller)
        # per instance: tp coordinate -> its KV partners in the other kind's layout, and variants
        self.overlaps, self.variant_of, self.variants = [], [], []
        for k, layout in enumerate(layouts):
            other = next(l for l, kind in zip(layouts, kinds) if kind != kinds[k])
            lists = [partners(a, layout.tp, other.tp, kv_heads, kinds[k] == "prefill") for a in range(layout.tp)]
            signatures = list(dict.fromkeys(tuple(u for _, u in p) for p in lists))
            self.overlaps.append(lists)
            self.variant_of.append([signatures.index(tuple(u for _, u in p)) for p in lists])
            self.variants.append(signatures)
        self.classes = [(k, s, e, v) for k, layout in enumerate(layouts) for s in range(layout.pp)
                        for e in range(layout.ep) for v in range(len(self.variants[k]))]
        self.index = {c: i for i, c in enumerate(self.classes)}

    @property
    def mesh(self):
        return self  # write_trace_set reads mesh.size

    def locate(self, rank: int) -> tuple[int, int, int, int]:
        """(instance, stage, engine, tp coordinate) of `rank`."""
        k = bisect.bisect_right(self.bases, rank) - 1
        layout, local = self.layouts[k], rank - self.bases[k]
        return k, local // (layout.tp * layout.ep), (local // layout.tp) % layout.ep, local % layout.tp

    def rank(self, k: int, stage: int, engine: int, a: int) -> int:
        layout = self.layouts[k]
        return self.bases[k] + stage * layout.tp * layout.ep + engine * layout.tp + a

    def class_of(self, rank: int) -> int:
        k, s, e, a = self.locate(rank)
        return self.index[(k, s, e, self.variant_of[k][a])]

    def representative(self, cls: int) -> int:
        k, s, e, v = self.classes[cls]
        return self.rank(k, s, e, self.variant_of[k].index(v))

    def class_count(self, cls: int) -> int:
        k, _, _, v = self.classes[cls]
        return self.variant_of[k].count(v)

    def signature(self, cls: int) -> tuple[int, ...]:
        """The overlap units of the class's ranks, per partner j."""
        k, _, _, v = self.classes[cls]
        return self.variants[k][v]

    def peer(self, rank: int, hole) -> int:
        k, s, e, a = self.locate(rank)
        if isinstance(hole, KVPeer):
            return self.rank(hole.instance, hole.stage, hole.engine, self.overlaps[k][a][hole.j][0])
        if hole.stage is None:
            return rank
        return self.rank(k, hole.stage, e, a)

    def hole_values(self, rank: int, holes) -> dict:
        width = rank_width(self.size)
        return {hole: str(self.group_ids.id(rank, hole)).encode() if isinstance(hole, GroupHole)
                else fixed_varint(self.peer(rank, hole), width) for hole in holes}

    @cached_property
    def group_ids(self) -> "InstanceGroups":
        kinds = [set() for _ in self.layouts]
        for (k, *_), program in zip(self.classes, self.programs):
            kinds[k] |= {h for h in program.holes if isinstance(h, GroupHole)}
        return InstanceGroups(self, [GroupIds.for_kinds(l.mesh(), kinds[k]) for k, l in enumerate(self.layouts)])

    def describe(self) -> list[dict]:
        return [{"instance": k, "kind": kind, "tp": l.tp, "pp": l.pp, "ep": l.ep, "first_rank": self.bases[k],
                 "ranks": l.size} for k, (l, kind) in enumerate(zip(self.layouts, self.kinds))]


class InstanceGroups:
    """Each instance's mesh groups (GroupIds), ranks shifted to the instance's block and ids
    offset by a multiple of 500 per instance (instances share no rank)."""

    def __init__(self, instances: InstanceSet, local: list[GroupIds]):
        self.instances, self.local, self.offsets = instances, local, []
        offset = 0
        for ids in local:
            self.offsets.append(offset)
            top = max((gid for gid, _ in ids.table()), default=0)
            offset += MODULUS * (top // MODULUS + 1)

    def id(self, rank: int, kind) -> int:
        k = bisect.bisect_right(self.instances.bases, rank) - 1
        return self.offsets[k] + self.local[k].id(rank - self.instances.bases[k], kind)

    def table(self):
        for k, ids in enumerate(self.local):
            base = self.instances.bases[k]
            for gid, members in ids.table():
                yield self.offsets[k] + gid, [base + m for m in members]
