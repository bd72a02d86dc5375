"""What a repeated action adds, worked out once: lowering runs an action of the schedule
whose key (virtual stage, kind, final or not, its micro-batch's earlier actions) it has run
before by repeating that run -- its stats tally without nodes (stg.evaluate), its nodes with
them (stg generate), its merged replay nodes as arrays when lowered for timing (stg explore).
The builder is stg/lower.py's _ProgramBuilder."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import chain, islice
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from stg.graph import VIEWS, OpKind
from stg.program import ClassStats, NodeType, Repeats, TraceNode, merged_runs, plain_key
from stg.sharding import ShardedGraph, by_identity, per_graph

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
        exprs, fields = self._by_field
        values = [(comm_evaluate if comm else evaluate)(expr) for comm, expr in exprs]
        for field, key, uses in fields:
            add_to(stats, field, key, sum(times * values[place] for place, times in uses))
        return stats

    @cached_property
    def _by_field(self) -> tuple[list[tuple[bool, object]], list[tuple[str, str | None, tuple]]]:
        """The terms as bind reads them: the distinct (comm, expression) pairs, each valued
        once (a stage's terms name a few dozen expressions many times over), and per (field,
        key) the places of its expressions with how many times each is added."""
        places: dict[tuple, int] = {}
        fields: dict[tuple, list] = {}
        for (field, key, comm, expr), times in self.terms.items():
            place = places.setdefault((comm, expr), len(places))
            fields.setdefault((field, key), []).append((place, times))
        return list(places), [(field, key, tuple(uses)) for (field, key), uses in fields.items()]


def combined(parts: Iterable[tuple[ActionTally, int]]) -> ActionTally:
    """One tally that adds what each (tally, times) of `parts` adds, `times` over (a stage's
    actions: the terms they share are bound once)."""
    terms: Counter = Counter()
    counts, holes = ClassStats(), set()
    for tally, times in parts:
        add_terms(terms, tally.terms, times)
        counts.add(tally.counts, times)
        holes |= tally.holes
    return ActionTally(terms, counts, frozenset(holes), ())


def add_terms(terms: Counter, other: Counter, times: int) -> None:
    """terms += times * other, in one pass over `other` (a stage's tallies hold thousands of
    terms, added for every layer and action of every new cut)."""
    if times == 1:
        terms.update(other)
        return
    found = terms.get
    for term, n in other.items():
        terms[term] = found(term, 0) + n * times


def alike_tally(known: dict, tally: ActionTally) -> ActionTally:
    """`tally`, sharing its terms and counts with an equal tally of the structure made before
    it (`known`: its tallies, stg.repeats.tallies): a pipeline's middle stages run the same
    layers once per micro-batch each, in other orders, and differ only in their peers (holes),
    so a plan binds them once (stg.lower._ProgramBuilder._bound)."""
    interned = known.setdefault(("alike",), {})
    content = (frozenset(tally.terms.items()), frozenset(tally.counts.nodes.items()),
               frozenset(tally.counts.comm_count.items()))
    first = interned.setdefault(content, tally)
    return tally if first is tally else ActionTally(first.terms, first.counts, tally.holes, tally.made)


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
    read_later: frozenset[int]  # offsets of nodes whose tensors later actions or the step may read
    roles: frozenset | None = None  # the role sets it refers to, when moved (see _roles)
    # timing: what its stats add for any sizes, and per node what its sizes come from (rebound)
    tally: ActionTally | None = None
    sized_by: tuple | None = None

    @classmethod
    def record(cls, builder: "_ProgramBuilder", microbatch: int, start: int, chains: dict, known: int, here: dict,
               stats: ClassStats, read_later: frozenset[str]) -> "ActionNodes | None":
        """The nodes from `start` on, as the action that just made them (`chains`: the chain
        roles before it; the first `known` of its micro-batch's tensors were made before it,
        the rest by it: a tensor is made once; `read_later`: those of its tensors that ops
        after it read) repeats them; None if it cannot."""
        outside = {d for node in builder.nodes[start:] for d in node.deps if d < start}
        roles_of: dict[int, set] = {}
        found = [(role, node) for role, node in chains.items() if node in outside]
        found += [(("tensor", t), node) for t, node in islice(here.items(), known) if node in outside]
        for role, node in found:
            roles_of.setdefault(node, set()).add(role)

        roles = {node: frozenset(its) for node, its in roles_of.items()}.get  # a node from before: its roles

        def ref(node: int):
            return node - start if node >= start else roles(node)

        nodes, computed, prefix, exact = [], chains[COMPUTE_ROLE] is not None, str(microbatch), builder.exact
        for node in builder.nodes[start:]:
            node_deps = node.deps
            deps = tuple([d - start if d >= start else roles(d) for d in node_deps])
            if None in deps:
                return None  # a dependency on something that plays no role: never repeated
            chained = node.type is _COMP and computed  # its first dependency: what ran last
            computed = computed or node.type is _COMP
            if chained:
                deps, node_deps = deps[1:], node_deps[1:]
            suffix = node.name[len(prefix):] if not builder.timing and node.name.startswith(prefix) and \
                not node.name[len(prefix)].isdigit() else None  # (timing repeats no names)
            inside = not node_deps or min(node_deps) >= start  # every dependency one of its own
            nodes.append((node, node.type, suffix, chained, deps, inside, exact.get(node.id)))
        exit = {("prefetch", phase): ref(node) for phase, node in builder.prefetch.items()
                if node is not None and chains.get(("prefetch", phase)) != node}
        exit.update((("tensor", t), ref(node)) for t, node in islice(here.items(), known, None))
        if any(v is None for v in exit.values()):
            return None
        later = frozenset(exit[("tensor", t)] for t in read_later if type(exit.get(("tensor", t))) is int)
        return cls(microbatch, tuple(nodes), frozenset(r for r, v in chains.items() if v is not None), exit,
                   stats, len(builder.pipeline.edges), later)

    def ending_runs_at(self, read_later: frozenset[str]) -> "ActionNodes":
        """These nodes, their merged runs (compact) ending at the nodes that make `read_later`
        instead: what recording them under that set gives. Not for a moved or rebound
        template, whose compact form is made otherwise."""
        exit = self.exit
        return replace(self, read_later=frozenset(exit[("tensor", t)] for t in read_later
                                                  if type(exit.get(("tensor", t))) is int))

    @cached_property
    def _exits(self) -> tuple[tuple[str, ...], tuple[int, ...], tuple]:
        """The exits as the tensors made by the action's own nodes (names, offsets) and the rest."""
        made = [(role[1], ref) for role, ref in self.exit.items() if role[0] == "tensor" and type(ref) is int]
        others = tuple((role, ref) for role, ref in self.exit.items() if role[0] != "tensor" or type(ref) is not int)
        return tuple(name for name, _ in made), tuple(ref for _, ref in made), others

    @cached_property
    def names(self) -> frozenset[str]:
        """The tensors its exits and dependencies name (what `moved` renames)."""
        exits = (role[1] for role in self.exit if role[0] == "tensor")
        return frozenset(chain(exits, (r[1] for roles in self._roles for r in roles if r[0] == "tensor")))

    @cached_property
    def _roles(self) -> frozenset:
        """Every set of roles a dependency or an exit refers to."""
        if self.roles is not None:
            return self.roles
        refs = {d for entry in self.nodes if not entry[5] for d in entry[4] if type(d) is frozenset}
        return frozenset(refs | {r for r in self.exit.values() if type(r) is frozenset})

    @cached_property
    def _lookups(self) -> tuple[tuple[frozenset, tuple[tuple[bool, object], ...]], ...]:
        """Each set of roles (_roles) with where each of its roles is found: (True, a tensor's
        name) in its micro-batch's producers, (False, a chain role) among the chains."""
        return tuple((roles, tuple((r[0] == "tensor", r[1] if r[0] == "tensor" else r) for r in roles))
                     for roles in self._roles)

    def _resolve(self, builder: "_ProgramBuilder", here: dict, rename: dict | None = None) -> dict | None:
        """Each set of roles -> the node that plays them all now; None if the chains set differ
        from the recorded run's or a set does not name one node. `rename`: its tensors' names
        here (LayerNodes), a set's tensors not among them left out (a node from before that is
        also the comm chain's last is found by that role)."""
        if not builder.chains_present(self.present):
            return None
        resolved, chain = {}, builder.chain_role
        for roles, lookups in self._lookups:
            if rename is not None:
                lookups = [(tensor, rename[key] if tensor else key) for tensor, key in lookups
                           if not tensor or key in rename] or [(True, None)]
            if len(lookups) == 1:  # most sets: one role
                tensor, key = lookups[0]
                node = here.get(key) if tensor else chain(key)
            else:
                found = {here.get(key) if tensor else chain(key) for tensor, key in lookups}
                if len(found) != 1:
                    return None
                node = found.pop()
            if node is None:
                return None
            resolved[roles] = node
        return resolved

    def replay(self, builder: "_ProgramBuilder", microbatch: int, here: dict) -> bool:
        resolved = self._resolve(builder, here)
        if resolved is None:
            return False
        if builder.timing:
            self._replay_compact(builder, microbatch, resolved)
        else:
            self._replay_nodes(builder, microbatch, resolved)
        self._exit_into(builder, here, len(builder.nodes) - len(self.nodes), resolved)
        builder.repeated(self.stats)
        return True

    def _exit_into(self, builder: "_ProgramBuilder", here: dict, start: int, resolved: dict,
                   rename: dict | None = None) -> None:
        """Note what the nodes repeated from `start` on make (`here`) and the prefetch point
        they leave; `rename`: the tensors' names here (LayerNodes)."""
        names, offsets, others = self._exits
        if rename is not None:
            names = map(rename.__getitem__, names)
        here.update(zip(names, map(start.__add__, offsets)))  # the tensors it makes, made here
        for role, ref in others:
            node = start + ref if type(ref) is int else resolved[ref]
            if role[0] == "prefetch":
                builder.prefetch[role[1]] = node
            else:
                here[role[1] if rename is None else rename[role[1]]] = node

    def _replay_nodes(self, builder: "_ProgramBuilder", microbatch: int, resolved: dict) -> None:
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

    def moved(self, rename: dict[str, str], retag: dict[int, int], peers: dict,
              reads_all: bool = False) -> "ActionNodes | None":
        """These nodes as another pipeline stage's action of the same shape makes them (timing
        only: nodes keep their names and only the merged replay form is moved): its tensors
        under `rename`, its sends and receives on the edges `retag` maps edge indices to, their
        peers under `peers`; None if a tensor it refers to has no new name. `reads_all`: the
        shape names every tensor the nodes read and the tensors those view (a step's), so a node
        from before that a dependency names also by a tensor the shape lacks (the compute or
        comm chain's last, which made it) is named by its other roles."""
        def roles(refs):
            if reads_all:
                refs = [r for r in refs if r[0] != "tensor" or r[1] in rename] or refs
            return frozenset(("tensor", rename[r[1]]) if r[0] == "tensor" else r for r in refs)

        try:
            exit = {(role[0], rename[role[1]]) if role[0] == "tensor" else role: ref if type(ref) is int else roles(ref)
                    for role, ref in self.exit.items()}
            compact = replace(self.rekeyed(retag, peers),
                              outside_roles=tuple(r if r is _CHAIN else roles(r) for r in self.compact.outside_roles))
        except KeyError:
            return None
        moved = replace(self, exit=exit, roles=frozenset(map(roles, self._roles)))
        if "_sizing" in self.__dict__:  # (its nodes are these: only names move; see rebound)
            moved.__dict__["_sizing"] = self.__dict__["_sizing"]
        moved.__dict__["compact"] = compact  # cached_properties' slots
        names, offsets, others = self._exits  # renamed as `exit` is, in its order
        moved.__dict__["_exits"] = (tuple(map(rename.__getitem__, names)), offsets,
                                    tuple(((role[0], rename[role[1]]) if role[0] == "tensor" else role,
                                           ref if type(ref) is int else roles(ref)) for role, ref in others))
        return moved

    def rekeyed(self, retag: dict[int, int], peers: dict) -> "_Compact":
        """The compact form with its sends and receives on the edges `retag` maps edge indices
        to, its peers and holes under `peers`, as `moved` moves them (KeyError: an edge `retag`
        does not map); what a stage that keeps an alike stage's names repeats (stg/borrowed.py)."""
        def p2p(key):
            src, dst, tag, size = key
            return peers.get(src, src), peers.get(dst, dst), tag - tag % self.edges + retag[tag % self.edges], size

        c = self.compact
        # a copy of its fields and cached_properties, but `keys`, which reads the keys (a
        # dataclass replace costs more than the rest: every middle stage rekeys each template)
        rekeyed = object.__new__(type(c))
        rekeyed.__dict__.update(c.__dict__, p2p_keys=tuple(map(p2p, c.p2p_keys)),
                                holes=frozenset(peers.get(h, h) for h in c.holes) if c.holes else c.holes)
        rekeyed.__dict__.pop("keys", None)
        return rekeyed

    @cached_property
    def compact(self) -> "_Compact":
        return _Compact.of(self)

    def rebound(self, builder: "_ProgramBuilder") -> "ActionNodes":
        """This recorded action under the sizes of `builder`'s plan (timing only): the same
        nodes and dependencies -- its shape holds all they depend on but sizes -- each COMP
        node lasting what its op lasts there, each collective, send and receive moving the bytes
        its ops or tensor hold there, its stats its tally bound there."""
        sizing, comm = self.__dict__.get("_sizing"), builder.comm_ev
        if sizing is None:  # (its structure's: a template is rebound in the plans of its stage cut)
            sizing = self.__dict__["_sizing"] = self._sizing_of(builder.origins)
        stands_for, keys, which, collective_bytes, p2p_bytes = sizing
        timed = builder.ev.timing.setdefault(("rebound", id(builder.device)), {})  # the plan's, by origin and costs
        get, costs = timed.get, builder._costs  # (its keys hold sympy expressions: one hash a lookup)
        exacts = np.array([exact if (exact := get(key)) is not None else timed.setdefault(key, costs(op)[2])
                           for op, key in zip(stands_for, keys)], dtype=np.float64)[which]
        collectives = [sum(map(comm, exprs)) for exprs in collective_bytes]
        p2p = list(map(comm, p2p_bytes))
        c = self.compact
        compact = replace(c, exacts=exacts,
                          collective_keys=tuple((group, kind, n) for (group, kind, _), n in zip(c.collective_keys,
                                                                                                collectives)),
                          p2p_keys=tuple((src, dst, tag, n) for (src, dst, tag, _), n in zip(c.p2p_keys, p2p)))
        rebound = replace(self, stats=self.tally.bind(builder.ev, comm))
        rebound.__dict__.update(self._sized_alike(), compact=compact)
        return rebound

    def _sized_alike(self) -> dict:
        """What this template has worked out that a copy with other stats, sizes or peers
        (rebound, moved) shares: its nodes' sizing and roles (cached_properties' slots)."""
        return {name: value for name, value in self.__dict__.items()
                if name in ("_sizing", "_roles", "_lookups", "_exits", "names")}

    def _sizing_of(self, origins: Mapping[str, str]) -> tuple:
        """What `rebound` reads of the nodes' sizes: the ops that stand for the COMP nodes (one
        per origin and cost expressions: lowering times those alike, _ProgramBuilder._costs),
        those keys, and per COMP node its op's place among them; per collective its ops'
        bytes; per send and receive its bytes."""
        place, which, collective_bytes, p2p_bytes = {}, [], [], []  # place: by origin and costs, its op
        for entry, sized_by in zip(self.nodes, self.sized_by):
            if entry[1] is _COMP:
                key = (origins.get(sized_by.name) or sized_by.name, sized_by.flops, sized_by.bytes)
                which.append(place.setdefault(key, (len(place), sized_by))[0])
            elif entry[1] is _COLL:
                collective_bytes.append(tuple(op.bytes for op in sized_by))
            else:
                p2p_bytes.append(sized_by)
        return (tuple(op for _, op in place.values()), tuple(place), np.array(which, dtype=np.int64),
                tuple(collective_bytes), tuple(p2p_bytes))

    def _replay_compact(self, builder: "_ProgramBuilder", microbatch: int, resolved: dict) -> None:
        """The action's nodes as the timed replay reads them, put off (builder.pending) until
        flush_compact adds them to builder.replay; its node ids are taken (builder.nodes holds
        None for them) but no node is made. What a later action looks up (the merged runs'
        heads, the chains' last nodes) is set at once."""
        c, start = self.compact, len(builder.nodes)
        builder.nodes.extend(c.no_nodes)
        self._pend(builder, start, resolved, builder.last_compute, (microbatch - self.microbatch) * self.edges)
        if c.last_compute is not None:
            builder.last_compute = start + c.last_compute
        if c.last_comm is not None:
            builder.last_comm = start + c.last_comm

    def pend_recorded(self, builder: "_ProgramBuilder", start: int, chains: dict, here: dict) -> None:
        """Timing: the nodes the action just recorded made (from `start` on), put off for
        flush_compact as its repeats' are, their dependencies from before it found by role among
        the `chains` and tensors it found (each role of a set names the same node). The caller
        sets the carry back to where it stood before the action: the flush rounds again."""
        resolved = {roles: here.get(key) if tensor else chains.get(key) for roles, ((tensor, key), *_) in self._lookups}
        self._pend(builder, start, resolved, chains[COMPUTE_ROLE], 0)

    def _pend(self, builder: "_ProgramBuilder", start: int, resolved: dict, last: int | None, shift: int) -> None:
        """Put the nodes off (builder.pending) from `start` on, `resolved` naming the nodes before
        them, `last` the compute chain's last; tags shifted by `shift`. What a later action looks
        up of them (the merged runs' heads) is set at once."""
        c, head_of = self.compact, builder.head_of
        head = head_of.get
        outside = [head(last, last) if roles is _CHAIN else head(node := resolved[roles], node)
                   for roles in c.outside_roles]
        builder.pending.append((c, start, outside, shift))
        if c.tails:
            tails, firsts = c.tail_offsets
            head_of.update(zip(map(start.__add__, tails), map(start.__add__, firsts)))


@dataclass(frozen=True)
class LayerNodes:
    """The nodes of one layer of an action being recorded for timing, which the later layers
    of its run with the same shape (stg.shapes.layer_shape: their ops equal but for names,
    the names in the same places of the shape's name table) repeat under their own names
    instead of running their ops (stg.lower._ProgramBuilder.action): the same nodes, numbered
    on, the tensors they read from before found under the layer's names, the same stats."""

    nodes: ActionNodes
    names: tuple[str, ...]  # the layer's, in its shape's order
    terms: Counter  # what its stats add, for any sizes (ActionTally)
    noted: tuple[int, ...]  # the places of the tensors it makes that builder.where notes

    @classmethod
    def record(cls, builder: "_ProgramBuilder", microbatch: int, start: int, chains: dict, known: int, here: dict,
               stats: ClassStats, terms: Counter, names: tuple[str, ...], ops: list) -> "LayerNodes | None":
        """The layer's nodes from `start` on (ActionNodes.record's arguments), with its terms."""
        nodes = ActionNodes.record(builder, microbatch, start, chains, known, here, stats, frozenset())
        if nodes is None:
            return None
        nodes = replace(nodes, sized_by=tuple(map(builder.sized_by.get, range(start, len(builder.nodes)))))
        return cls(nodes, names, terms, _noted_places(builder, names, ops))

    def repeat(self, builder: "_ProgramBuilder", names: tuple[str, ...], ops: list, here: dict) -> bool:
        """Add the layer's nodes as the layer of `names` and `ops` makes them; False (nothing
        added) if what they read from before is not found under its names, or it notes other
        tensors than this one (a tensor read past the stage, say)."""
        if _noted_places(builder, names, ops) != self.noted:
            return False
        rename, template = dict(zip(self.names, names)), self.nodes
        resolved = template._resolve(builder, here, rename)
        if resolved is None:
            return False
        start = len(builder.nodes)
        template._replay_nodes(builder, template.microbatch, resolved)
        # what lowering notes of each node it makes (_ProgramBuilder.compute, _add)
        builder.exact.update((start + n, entry[6]) for n, entry in enumerate(template.nodes) if entry[1] is _COMP)
        builder.sized_by.update(zip(range(start, len(builder.nodes)), template.sized_by))
        builder.stats.add(template.stats)
        if builder.terms is not None:
            add_terms(builder.terms, self.terms, 1)
        template._exit_into(builder, here, start, resolved, rename)
        builder.alias.update((op.outputs[0], op.inputs[0]) for op in ops if op.kind in VIEWS)
        return True


def _noted_places(builder: "_ProgramBuilder", names: tuple[str, ...], ops: list) -> tuple[int, ...]:
    """The places among `names` of the tensors `ops` make that a timing build notes (a compute
    node's when builder._noted holds it, a collective's always)."""
    noted = builder._noted
    made = {out for op in ops for out in op.outputs
            if op.kind is OpKind.COLLECTIVE or (op.kind not in VIEWS and out in noted)}
    return tuple(place for place, name in enumerate(names) if name in made)


def flush_compact(builder: "_ProgramBuilder") -> None:
    """Add the repeated actions put off since the last flush (ActionNodes._replay_compact) to
    builder.replay, in order, as one part (stg.program.Repeats: the rows they make, their
    durations rounded on the running carry, are made in one compiled loop over the repeats
    when asked for, stg/repeats_kernel.py; a long pipeline repeats tens of thousands of
    actions). Lowering flushes before it makes a node of its own, which reads the carry and
    the comm nodes and comes after them in the replay, and at the end."""
    pending, builder.pending = builder.pending, []
    if not pending:
        return
    place: dict[int, int] = {}  # a template's id -> its place among the distinct ones
    templates: list[_Compact] = []
    serials = []  # per entry, its template's place
    for entry in pending:
        serial = place.get(id(entry[0]))
        if serial is None:
            serial = place[id(entry[0])] = len(templates)
            templates.append(entry[0])
        serials.append(serial)
    starts, shifts = (np.array([entry[k] for entry in pending], dtype=np.int64) for k in (1, 3))
    flush_arrays(builder, templates, np.array(serials, dtype=np.int64), starts, shifts,
                 np.fromiter(chain.from_iterable(entry[2] for entry in pending), dtype=np.int64))


def flush_arrays(builder: "_ProgramBuilder", templates: list[_Compact], serials: np.ndarray, starts: np.ndarray,
                 shifts: np.ndarray, outside: np.ndarray, joined: dict | None = None) -> None:
    """flush_compact's repeats given as arrays: per repeat its template (an index into
    `templates`), first node id and tag shift, and the nodes from before it that its
    dependencies name, all repeats' in order (stg/borrowed.py wires a whole stage so).
    `joined`: where the templates' arrays joined are kept for the next flush of templates
    with the same arrays (alike stages' differ in their keys alone)."""
    packed, at, exacts, exact_at, key_at, key_group, group_first = joined_arrays(templates, joined)
    repeats = Repeats(packed, at, exacts, exact_at, key_at, serials, starts, shifts, outside, builder.carry,
                      tuple(chain.from_iterable(c.keys for c in templates)), key_group, group_first)
    # their rows wait until asked for (explore's replay reads the repeats), and so do the carry
    # after them and their comm nodes, which only nodes lowered after them read
    builder.carried_by = repeats
    for c in templates:
        builder.holes |= c.holes
    builder.comm_later.append(repeats)
    builder.replay.add_repeats(repeats)


def offsets(sizes: list[int]) -> np.ndarray:
    """Where each part starts when parts of `sizes` are joined end to end."""
    return np.cumsum([0, *sizes[:-1]], dtype=np.int64)


def joined_arrays(templates: list[_Compact], joined: dict | None) -> tuple[np.ndarray, ...]:
    """Repeats' packed templates, their places, the durations, their places, the keys' places,
    each key's group and each group's first key (kept in `joined` for templates with the same
    arrays)."""
    packed, exacts = [c.packed for c in templates], [c.exacts for c in templates]
    groups = [c.key_groups for c in templates]

    def join() -> tuple[np.ndarray, ...]:
        key_at = offsets([len(group) for group, _ in groups])
        group_at = offsets([len(first) for _, first in groups])
        return (np.concatenate(packed), offsets(list(map(len, packed))), np.concatenate(exacts),
                offsets(list(map(len, exacts))), key_at,
                np.concatenate([group + at for (group, _), at in zip(groups, group_at)]),
                np.concatenate([first + at for (_, first), at in zip(groups, key_at)]))
    return by_identity(joined, (*packed, *exacts, *(group for group, _ in groups)), join)


COMPUTE_ROLE, COMM_ROLE = ("chain", "compute"), ("chain", "comm")  # the chains' last nodes' roles
_CHAIN = frozenset({COMPUTE_ROLE})  # a COMP node's first dependency: what ran last


@dataclass(frozen=True)
class _Compact:
    """A repeated action's nodes merged for the timed replay as a program's are
    (stg.program.merged_runs): a COMP node whose one dependency is the COMP node before it,
    which nothing else reads, joins that node's run. A node that later nodes may read (a
    tensor that a later collective reads, the chains' last nodes, the prefetch point) ends
    its run."""

    kept: np.ndarray  # offsets of each run's first node (and of every other node)
    head: tuple[int, ...]  # per offset: its run's first node
    types: np.ndarray  # per kept node
    n_deps: np.ndarray  # per kept node
    deps: np.ndarray  # flat: kept offsets, and at outside_at the nodes from before (0 here)
    outside_at: np.ndarray
    outside_roles: tuple[frozenset, ...]  # the roles of those (_CHAIN: the compute chain's last)
    collective_keys: tuple  # the collectives' (group, type, bytes)
    p2p_keys: tuple  # the sends' and receives' (src, dst, tag, bytes)
    exacts: np.ndarray  # per COMP node in order: its unrounded duration
    runs: np.ndarray  # per COMP node: the index in `kept` of its run
    # (last node, first node) of each run of several whose last node a later node may name
    # (what ends runs: a later node names no other node of a merged run)
    tails: tuple[tuple[int, int], ...]
    comm_offsets: np.ndarray
    last_compute: int | None
    last_comm: int | None
    keyed: np.ndarray  # kept indices of the collectives, then of the sends and receives
    holes: frozenset

    @cached_property
    def tail_offsets(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """`tails` as two columns: the last nodes, their runs' first nodes."""
        return tuple(tail for tail, _ in self.tails), tuple(first for _, first in self.tails)

    @cached_property
    def key_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """The keys grouped by value: each key's group, each group's first key (a slice's sweep
        translates a value once: stg/chakra/repeat_paths.py). A copy whose keys are a function
        of these (rekeyed) keeps them: equal keys stay equal."""
        found: dict[tuple, int] = {}
        group = [found.setdefault(key, len(found)) for key in map(plain_key, self.keys)]
        first: list[int] = []
        for k, g in enumerate(group):
            if g == len(first):  # (numbered as they first appear)
                first.append(k)
        return np.array(group, dtype=np.int64), np.array(first, dtype=np.int64)

    @cached_property
    def packed(self) -> np.ndarray:
        """The arrays a repeat's rows are made from, in one (stg/repeats_kernel.py says how)."""
        # per keyed node, 1 for a send or receive (a repeat shifts its tag)
        sends_or_receives = np.repeat(np.array([0, 1], dtype=np.int64), [len(self.collective_keys),
                                                                         len(self.p2p_keys)])
        counts = (len(self.kept), len(self.deps), len(self.outside_at), len(self.exacts), len(self.keyed),
                  len(self.comm_offsets))
        deps = self.deps.copy()
        deps[self.outside_at] = -1 - np.arange(len(self.outside_at))  # the j-th from before: -1 - j
        keyed_as = np.full(len(self.kept), -1, dtype=np.int64)
        keyed_as[self.keyed] = np.arange(len(self.keyed))
        return np.concatenate([np.array(counts, dtype=np.int64), self.kept, self.types, self.n_deps, deps,
                               self.outside_at, self.runs, self.keyed, sends_or_receives, self.comm_offsets,
                               keyed_as])

    @cached_property
    def keys(self) -> tuple:
        """The keys of `keyed`: the collectives', then the sends' and receives'."""
        return self.collective_keys + self.p2p_keys

    @cached_property
    def no_nodes(self) -> tuple[None, ...]:
        """A None per node: the ids a repeat takes in builder.nodes."""
        return (None,) * len(self.head)

    @classmethod
    def of(cls, action: ActionNodes) -> "_Compact":
        entries = action.nodes
        last_compute = max((n for n, e in enumerate(entries) if e[1] is _COMP), default=None)
        last_comm = max((n for n, e in enumerate(entries) if e[1] is not _COMP and e[1] is not _RECV), default=None)
        prefetch = {r for role, r in action.exit.items() if role[0] == "prefetch" and type(r) is int}
        kept_by = action.read_later | prefetch | {last_compute, last_comm}
        previous, chain_of = None, {}  # a chained COMP node -> the COMP node before it in the action
        for n, e in enumerate(entries):
            if e[1] is _COMP:
                if e[3] and previous is not None:
                    chain_of[n] = previous
                previous = n
        local = [((chain_of.get(n, -1),) if e[3] else ()) + (e[4] if e[5] else tuple(d if type(d) is int else -1
                                                                                       for d in e[4]))
                 for n, e in enumerate(entries)]
        head = merged_runs([e[1] is _COMP for e in entries], local, kept_by)
        index, kept, types, deps, comm, exacts, runs, holes = {}, [], [], [], [], [], [], set()
        for n, (node, kind, _, chained, node_deps, own, exact) in enumerate(entries):
            if head[n] == n:
                index[n] = len(kept)
                kept.append(n)
                types.append(int(kind))
                d = chain_of.get(n)
                first = (() if not chained else (d,) if d is not None else (_CHAIN,))
                if own and first != (_CHAIN,):  # every dependency one of its own (most nodes)
                    deps.append(tuple(sorted({head[x] for x in first + node_deps})))
                else:
                    inside = sorted({head[x] for x in first + node_deps if type(x) is int})
                    deps.append((*inside, *dict.fromkeys(x for x in first + node_deps if type(x) is not int)))
                if kind is not _COMP:  # a compute node matches nothing and names no rank
                    comm.append(node.comm_key)
                    holes.update(node.holes)
                else:
                    comm.append(None)
            if kind is _COMP:
                exacts.append(exact)
                runs.append(index[head[n]])
        tails = {}
        for n, first in enumerate(head):
            if first != n:
                tails[first] = n
        flat = [d for node_deps in deps for d in node_deps]
        outside_at = [i for i, d in enumerate(flat) if type(d) is not int]
        ints = lambda values: np.array(values, dtype=np.int64)
        collectives = [k for k, key in enumerate(comm) if key and len(key) == 3]
        p2p = [k for k, key in enumerate(comm) if key and len(key) == 4]
        return cls(ints(kept), tuple(head), ints(types), ints([len(d) for d in deps]),
                   ints([d if type(d) is int else 0 for d in flat]), ints(outside_at),
                   tuple(flat[i] for i in outside_at), tuple(comm[k] for k in collectives),
                   tuple(comm[k] for k in p2p),
                   np.array(exacts, dtype=np.float64), ints(runs),
                   tuple((tail, first) for first, tail in tails.items() if tail in kept_by),
                   ints([n for n, e in enumerate(entries) if e[1] is not _COMP]), last_compute, last_comm,
                   ints(collectives + p2p), frozenset(holes))
