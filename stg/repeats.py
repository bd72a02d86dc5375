"""What a repeated action adds, worked out once: lowering runs an action of the schedule
whose key (virtual stage, kind, final or not, its micro-batch's earlier actions) it has run
before by repeating that run -- its stats tally without nodes (stg.evaluate), its nodes with
them (stg generate). The builder is stg/lower.py's _ProgramBuilder."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from stg.program import ClassStats, NodeType, TraceNode
from stg.sharding import ShardedGraph, per_graph

if TYPE_CHECKING:
    from stg.lower import Evaluator, _ProgramBuilder


@dataclass(frozen=True)
class ActionTally:
    """What one action adds to a class's stats, for any bindings: (field, key, shared, expr)
    -> how many times the expression's value is added; the node and collective counts; the
    holes; the tensors it makes."""

    terms: Counter
    counts: ClassStats  # its flops and bytes are this plan's; only nodes and comm_count are read
    holes: frozenset
    made: tuple[str, ...]

    def bind(self, evaluate: Evaluator, comm_evaluate: Evaluator) -> ClassStats:
        stats = ClassStats(comm_count=Counter(self.counts.comm_count), nodes=Counter(self.counts.nodes))
        for (field, key, comm, expr), times in self.terms.items():
            add_to(stats, field, key, times * (comm_evaluate if comm else evaluate)(expr))
        return stats


def add_to(stats: ClassStats, field: str, key: str | None, value: int) -> None:
    """stats.field += value, or stats.field[key] += value for a Counter field."""
    if key is None:
        setattr(stats, field, getattr(stats, field) + value)
    else:
        getattr(stats, field)[key] += value


@per_graph
def tallies(sharded: ShardedGraph) -> dict:
    """Action tallies of a structure, filled as plans are evaluated (_action_stats)."""
    return {}


_COMP, _COLL, _RECV = NodeType.COMP_NODE, NodeType.COMM_COLL_NODE, NodeType.COMM_RECV_NODE


@dataclass(frozen=True)
class ActionNodes:
    """The nodes of one action, as a class's later actions with its key repeat them. Per node:
    the node (id, name, duration and tag to be redone), whether its name starts with the
    micro-batch, whether its first dependency is the compute chain's last node, and its other
    dependencies -- an int is a node of the action (its offset), a frozenset the roles that a
    node from before the action played (stg.lower._ProgramBuilder.chain_roles, or
    ("tensor", name): the producer of its micro-batch's tensor). Also: the chain roles set at
    entry, the prefetch and tensor roles at exit, and the stats the action added."""

    microbatch: int
    nodes: tuple[tuple[TraceNode, NodeType, str | None, bool, tuple, bool, float | None], ...]
    present: frozenset  # chain roles that were set at entry
    exit: dict  # prefetch and tensor roles the action set -> an offset or roles
    stats: ClassStats
    edges: int

    @classmethod
    def record(cls, builder: "_ProgramBuilder", microbatch: int, start: int, chains: dict, known: int, here: dict,
               stats: ClassStats) -> "ActionNodes | None":
        """The nodes from `start` on, as the action that just made them (`chains`: the chain
        roles before it; the first `known` of its micro-batch's tensors were made before it,
        the rest by it: a tensor is made once) repeats them; None if it cannot."""
        outside = {d for node in builder.nodes[start:] for d in node.deps if d < start}
        roles_of: dict[int, set] = {}
        found = [(role, node) for role, node in chains.items() if node in outside]
        found += [(("tensor", t), node) for t, node in islice(here.items(), known) if node in outside]
        for role, node in found:
            roles_of.setdefault(node, set()).add(role)

        def ref(node: int):
            if node >= start:
                return node - start
            return frozenset(roles_of[node]) if node in roles_of else None

        nodes, computed, prefix = [], chains[("chain", "compute")] is not None, str(microbatch)
        for node in builder.nodes[start:]:
            deps = tuple(ref(d) for d in node.deps)
            if None in deps:
                return None  # a dependency on something that plays no role: never repeated
            chained = node.type is NodeType.COMP_NODE and computed  # its first dependency: what ran last
            computed = computed or node.type is NodeType.COMP_NODE
            deps = deps[1:] if chained else deps
            suffix = node.name[len(prefix):] if node.name.startswith(prefix) and \
                not node.name[len(prefix)].isdigit() else None
            inside = all(type(d) is int for d in deps)
            nodes.append((node, node.type, suffix, chained, deps, inside, builder.exact.get(node.id)))
        exit = {("prefetch", phase): ref(node) for phase, node in builder.prefetch.items()
                if node is not None and chains.get(("prefetch", phase)) != node}
        exit.update((("tensor", t), ref(node)) for t, node in islice(here.items(), known, None))
        if any(v is None for v in exit.values()):
            return None
        return cls(microbatch, tuple(nodes), frozenset(r for r, v in chains.items() if v is not None), exit,
                   stats, len(builder.pipeline.edges))

    def replay(self, builder: "_ProgramBuilder", microbatch: int, here: dict) -> bool:
        chains = builder.chain_roles()
        if frozenset(r for r, v in chains.items() if v is not None) != self.present:
            return False
        resolved = {}
        for _, _, _, _, deps, inside, _ in self.nodes:
            for d in () if inside else deps:
                if type(d) is frozenset and d not in resolved:
                    found = {here.get(r[1]) if r[0] == "tensor" else chains.get(r) for r in d}
                    resolved[d] = found.pop() if len(found) == 1 else None
        for ref in self.exit.values():
            if type(ref) is frozenset and ref not in resolved:
                found = {here.get(r[1]) if r[0] == "tensor" else chains.get(r) for r in ref}
                resolved[ref] = found.pop() if len(found) == 1 else None
        if None in resolved.values():
            return False
        start, name, shift = len(builder.nodes), str(microbatch), (microbatch - self.microbatch) * self.edges
        nodes, comm_ids, carry = builder.nodes, builder.comm_ids, builder.carry
        last_compute, last_comm = builder.last_compute, builder.last_comm
        new, setattr_ = object.__new__, object.__setattr__
        for n, (node, kind, suffix, chained, deps, inside, exact) in enumerate(self.nodes):
            if inside:
                ids = tuple([start + d for d in deps])
            else:
                ids = tuple(sorted({start + d if type(d) is int else resolved[d] for d in deps}))
            fields = node.__dict__.copy()
            fields["id"] = start + n
            fields["deps"] = (last_compute, *ids) if chained else ids
            if suffix is not None:
                fields["name"] = name + suffix
            if kind is _COMP:  # lowering's rounding (_ProgramBuilder._rounded), inline
                exact += carry
                fields["duration_us"] = duration = round(exact) if exact > 0 else 0
                carry = exact - duration
                last_compute = start + n
            else:
                comm_ids.add(start + n)
                if kind is not _COLL:
                    fields["tag"] = node.tag + shift
                if kind is not _RECV:
                    last_comm = start + n
            copy = new(TraceNode)
            setattr_(copy, "__dict__", fields)
            nodes.append(copy)
        builder.carry, builder.last_compute, builder.last_comm = carry, last_compute, last_comm
        for role, ref in self.exit.items():
            node = start + ref if type(ref) is int else resolved[ref]
            if role[0] == "prefetch":
                builder.prefetch[role[1]] = node
            else:
                here[role[1]] = node
        builder.stats.add(self.stats)
        return True
