"""The network model: tiers of bandwidth, and the time of each collective on them.

A network file (stg/data/networks/*.yaml) lists tiers from the innermost out: a tier of size s
joins blocks of s consecutive ranks (ranks r and q share a tier-i domain when r // s == q // s;
the last tier's size may be null, the whole cluster). Each tier has a bandwidth per GPU
(GB/s each way, GB = 1e9 B), a latency per algorithm step and an efficiency (the fraction of the
link that NCCL's bus bandwidth reaches). A group pays the slowest tier it spans: the
outermost tier whose domain its members need, with n = the group's size.

Collective times (S = the collective's full per-rank buffer; Chakra's ALL_GATHER comm_size is
the per-rank shard s, S = n·s; B = bandwidth x efficiency; L = latency), NCCL's ring and tree:

    ring ALL_REDUCE      2(n-1)·L + 2(n-1)/n · S / B     (nccl-tests busbw factor 2(n-1)/n)
    ring REDUCE_SCATTER   (n-1)·L +  (n-1)/n · S / B     (busbw factor (n-1)/n)
    ring ALL_GATHER       (n-1)·L +  (n-1)   · s / B     (the same, in the shard)
    ALL_TO_ALL            (n-1)·L +  (n-1)/n · S / B     (direct: n-1 pairwise exchanges)
    tree ALL_REDUCE  2⌈log2 n⌉·L + 2 · S / B             (double binary tree: reduce up,
                                                          broadcast down, each rank sending
                                                          and receiving S once per phase)
    SEND / RECV               L + S / B

A one-rank group costs nothing. This is what `stg validate --timed alpha-beta --network`
charges on a written set and what `stg explore` charges on a pipeline slice.

Two choices let the model match ASTRA-sim's analytical backend (stg/explore/astra.py derives
its configuration from the same file):

    all_to_all: ring     ASTRA-sim's ring all-to-all relays every message around the ring:
                         n(n-1)/2 steps of S/n, i.e. n(n-1)/2·L + (n-1)/2 · S / B
    hierarchical: true   a collective over every rank of a multi-tier network runs tier by
                         tier, innermost first, as ASTRA-sim's multi-dimensional collectives
                         (collective-optimization localBWAware): all-reduce = reduce-scatter on
                         each inner tier (the buffer shrinking by its size), all-reduce on the
                         outermost, all-gather back out; reduce-scatter inner to outer,
                         all-gather outer to inner, all-to-all the whole buffer on every tier.
                         A tier's "size" in ranks is its domain over the inner tier's domain.
    reduction_gbps: R    each of a ring reduce-scatter's or all-reduce's n-1 reducing steps
                         reads two messages and writes one at R GB/s: + 3(n-1)/n · S / R, as
                         ASTRA-sim charges its `local-mem-bw` (set R to the device's memory
                         bandwidth to match it; default: free, as NCCL overlaps it)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from stg.chakra import et_def_pb2 as pb
from stg.chakra.replay import RING_FACTOR
from stg.data import load
from stg.errors import PlanError


class Algorithm(Enum):
    """The all-reduce algorithm (reduce-scatter and all-gather always use the ring)."""

    RING = "ring"
    TREE = "tree"


class AllToAll(Enum):
    """The all-to-all algorithm: n-1 direct pairwise exchanges (NCCL), or ASTRA-sim's ring relay."""

    DIRECT = "direct"
    RING = "ring"


class Topology(Enum):
    """How a tier's domain is wired, as ASTRA-sim's analytical backend names its building blocks:
    a switch (every hop crosses two links: GPU-switch-GPU), a ring (a torus dimension; neighbours
    one link apart) or fully connected. stg's cost does not depend on it (L is per algorithm
    step); it decides the per-link latency of the derived ASTRA-sim network."""

    SWITCH = "switch"
    RING = "ring"
    FULLY_CONNECTED = "fully_connected"


@dataclass(frozen=True)
class Tier:
    name: str
    size: int | None  # ranks per domain; None: the whole cluster
    bandwidth_gbps: float  # per GPU, each way, GB = 1e9 B
    latency_us: float  # per algorithm step
    efficiency: float  # achieved / link bandwidth
    topology: Topology = Topology.SWITCH

    @property
    def bytes_per_us(self) -> float:
        return self.bandwidth_gbps * self.efficiency * 1e3


@dataclass(frozen=True)
class Network:
    name: str
    tiers: tuple[Tier, ...]
    all_reduce: Algorithm = Algorithm.RING
    all_to_all: AllToAll = AllToAll.DIRECT
    hierarchical: bool = False  # a collective over every rank runs tier by tier
    reduction_gbps: float | None = None  # local memory bandwidth of a reduction step (None: free)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise PlanError(f"network {self.name}: tiers: at least one tier")
        sizes = [t.size for t in self.tiers]
        if any(s is None for s in sizes[:-1]):
            raise PlanError(f"network {self.name}: tiers: only the last tier may have size null (the whole cluster)")
        for inner, outer in zip(sizes, sizes[1:]):
            if outer is not None and outer % inner:
                raise PlanError(f"network {self.name}: tiers: size {outer} is not a multiple of the inner tier's {inner}")

    def tier(self, low: int, high: int) -> Tier:
        """The innermost tier whose one domain holds ranks low..high (blocks are contiguous, so the
        lowest and highest member decide); beyond the last tier's size, the last tier."""
        for tier in self.tiers:
            if tier.size is None or low // tier.size == high // tier.size:
                return tier
        return self.tiers[-1]

    def collective_us(self, ctype: int, size: int, n: int, tier: Tier) -> float:
        """Time of one collective of `n` ranks with Chakra comm_size `size` on `tier`."""
        if n <= 1:
            return 0.0
        if ctype == pb.ALL_REDUCE and self.all_reduce is Algorithm.TREE:
            return 2 * math.ceil(math.log2(n)) * tier.latency_us + 2 * size / tier.bytes_per_us
        if ctype == pb.ALL_TO_ALL and self.all_to_all is AllToAll.RING:
            return n * (n - 1) / 2 * tier.latency_us + (n - 1) / 2 * size / tier.bytes_per_us
        steps = 2 * (n - 1) if ctype == pb.ALL_REDUCE else n - 1
        reduce = 0.0
        if self.reduction_gbps and ctype in (pb.ALL_REDUCE, pb.REDUCE_SCATTER):
            reduce = 3 * (n - 1) / n * size / (self.reduction_gbps * 1e3)  # n-1 steps: read 2, write 1 message
        return steps * tier.latency_us + RING_FACTOR[ctype](n) * size / tier.bytes_per_us + reduce

    def dims(self, world: int) -> list[int]:
        """Ranks per tier domain over the inner tier's domain (ASTRA-sim's npus_count per
        dimension) for a cluster of `world` ranks: tiers beyond the world are dropped, the last
        one kept holds the rest."""
        dims, inner = [], 1
        for tier in self.tiers:
            size = world if tier.size is None else min(tier.size, world)
            if size % inner or world % size:
                raise PlanError(f"network {self.name}: tiers: size {tier.size} does not divide the world of {world} ranks "
                                f"into whole domains of the inner tier's {inner}")
            dims.append(size // inner)
            inner = size
            if size == world:
                break
        if inner != world:
            dims[-1] *= world // inner
        return dims

    def hierarchical_us(self, ctype: int, size: int, world: int) -> float:
        """A collective over all `world` ranks run tier by tier (see the module's docstring)."""
        phases = [(n, tier) for n, tier in zip(self.dims(world), self.tiers) if n > 1]
        if not phases:
            return 0.0
        if ctype == pb.ALL_TO_ALL:
            return sum(self.collective_us(ctype, size, n, tier) for n, tier in phases)
        if ctype == pb.ALL_GATHER:  # outermost first; each tier gathers what the outer ones did
            total, shard = 0.0, size
            for n, tier in reversed(phases):
                total += self.collective_us(ctype, shard, n, tier)
                shard *= n
            return total
        total, buffer = 0.0, size
        inner = phases if ctype == pb.REDUCE_SCATTER else phases[:-1]
        for n, tier in inner:  # reduce-scatter in, and for all-reduce all-gather back out
            step = self.collective_us(pb.REDUCE_SCATTER, buffer, n, tier)
            total += step if ctype == pb.REDUCE_SCATTER else 2 * step
            buffer //= n
        if ctype == pb.ALL_REDUCE:
            n, tier = phases[-1]
            total += self.collective_us(ctype, buffer, n, tier)
        return total

    def send_us(self, size: int, tier: Tier) -> float:
        return tier.latency_us + size / tier.bytes_per_us

    def bind(self, groups: Mapping[int, Sequence[int]], ranks: Sequence[int] | None = None,
             world: int | None = None) -> "NetworkCost":
        """Costs for a replay whose group `g` has the real ranks `groups[g]` and whose replay rank
        i is real rank `ranks[i]` (default: the identity, a whole written set) in a cluster of
        `world` ranks (default: the highest rank in a group, plus one)."""
        return self.bound({g: (len(m), min(m), max(m)) for g, m in groups.items() if m}, ranks, world)

    def bound(self, spans: Mapping[int, tuple[int, int, int]], ranks: Sequence[int] | None = None,
              world: int | None = None) -> "NetworkCost":
        """`bind` from each group's size, lowest and highest rank (its distinct members), all a
        network reads of a group (GroupIds.span counts them without listing them)."""
        whole = set()
        if self.hierarchical and len(self.tiers) > 1 and spans:
            world = world or 1 + max((highest for _, _, highest in spans.values()), default=0)
            # distinct ranks from 0 to world - 1, world of them: every rank
            whole = {g for g, (n, lowest, highest) in spans.items() if n == world and lowest == 0
                     and highest == world - 1}
        return NetworkCost(self, {g: (n, self.tier(lowest, highest)) for g, (n, lowest, highest) in spans.items()
                                  if n}, tuple(ranks) if ranks is not None else None, frozenset(whole), world or 0)


@dataclass(frozen=True)
class NetworkCost:
    """A Network bound to one replay's groups (a BoundCost, see stg/chakra/replay.py)."""

    network: Network
    spans: Mapping[int, tuple[int, Tier]]  # group -> (members, the tier it pays)
    ranks: tuple[int, ...] | None
    whole: frozenset = frozenset()  # groups of every rank, costed tier by tier (hierarchical)
    world: int = 0

    def bind(self, groups) -> "NetworkCost":  # already bound to the real groups
        return self

    def collective_us(self, ctype: int, size: int, group: int) -> float:
        if group in self.whole:
            return self.network.hierarchical_us(ctype, size, self.world)
        n, tier = self.spans[group]
        return self.network.collective_us(ctype, size, n, tier)

    def send_us(self, src: int, dst: int, size: int) -> float:
        if self.ranks is not None:
            src, dst = self.ranks[src], self.ranks[dst]
        return self.network.send_us(size, self.network.tier(min(src, dst), max(src, dst)))


def _number(data: Mapping, key: str, where: str, *, positive: bool = True, most: float | None = None) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0) \
            or (most is not None and value > most):
        bound = f" and at most {most}" if most is not None else ""
        raise PlanError(f"{where}.{key}: must be a {'positive' if positive else 'non-negative'} number{bound}, got {value!r}")
    return float(value)


def network_from_dict(data: Mapping, where: str = "network") -> Network:
    tiers = data.get("tiers")
    if not isinstance(tiers, list) or not tiers:
        raise PlanError(f"{where}.tiers: must be a non-empty list of tiers")
    parsed = []
    for i, tier in enumerate(tiers):
        at = f"{where}.tiers[{i}]"
        if not isinstance(tier, Mapping):
            raise PlanError(f"{at}: must be a mapping")
        size = tier.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise PlanError(f"{at}.size: must be a positive integer or null, got {size!r}")
        parsed.append(Tier(str(tier.get("name", f"tier{i}")), size, _number(tier, "bandwidth_gbps", at),
                           _number(tier, "latency_us", at, positive=False), _number(tier, "efficiency", at, most=1.0),
                           _choice(tier, "topology", Topology, at)))
    hierarchical = data.get("hierarchical", False)
    if not isinstance(hierarchical, bool):
        raise PlanError(f"{where}.hierarchical: must be true or false, got {hierarchical!r}")
    reduction = None if data.get("reduction_gbps") is None else _number(data, "reduction_gbps", where)
    return Network(str(data.get("name", where)), tuple(parsed), _choice(data, "all_reduce", Algorithm, where),
                   _choice(data, "all_to_all", AllToAll, where), hierarchical, reduction)


def _choice(data: Mapping, key: str, kind: type[Enum], where: str):
    """The enum member named by data[key] (default: the enum's first member)."""
    value = data.get(key, next(iter(kind)).value)
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{where}.{key}: must be one of {[k.value for k in kind]}, got {value!r}") from None


def load_network(name_or_path: str | Path) -> Network:
    """A packaged network by name (stg/data/networks), or a network file by path."""
    return network_from_dict(load("networks", name_or_path), f"network {name_or_path}")
