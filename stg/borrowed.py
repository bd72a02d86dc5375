"""A middle pipeline stage lowered for timing in its sibling's names, its actions wired in one
compiled loop.

A middle stage cut like the plan's first middle stage makes that stage's nodes up to names,
peers and tags (stg.lower._ProgramBuilder._alike_stage), so it repeats that stage's templates:
every action and the step. ActionNodes.replay does so one action at a time -- it finds what
each depends on by role (a chain's last node, its micro-batch's producer of a tensor), notes
what it makes, and puts its nodes off for the flush -- in Python dicts of names, a few tens of
microseconds an action; a 32-stage pipeline of 32 micro-batches repeats 4,000 of them.

Here a stage keeps its sibling's names, as places (shapes.stage_likeness numbers them), the
producers of each micro-batch's tensors a row of an array, and one compiled loop
(stg/borrowed_kernel.py) does for every action at once what replay does. Renaming is
unobservable: the templates only look names up among what templates made. Python picks each
action's template (its key, as lowering finds it) and moves each template's sends and
receives to this stage's edges and peers (ActionNodes.rekeyed). A stage that a plan of other
sizes lowered from templates alone repeats those (StageTemplates), rebound to its sizes, in
its own names, the same way (wire_own). The nodes are those lowering would make, bit for bit
(tests/test_evaluate.py, the timing test).
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import TYPE_CHECKING, Callable

import numpy as np

from stg.program import ClassStats
from stg.repeats import _CHAIN, COMM_ROLE, COMPUTE_ROLE, ActionNodes, _Compact, flush_arrays, offsets
from stg.schedule import Order, walked
from stg.sharding import by_identity

if TYPE_CHECKING:
    from stg.lower import _ProgramBuilder

# a role's kind in the packed arrays (stg/borrowed_kernel.py reads them): a micro-batch
# tensor's producer, the compute or comm chain's last node, a prefetch point
TENSOR, COMPUTE, COMM, PREFETCH = 0, 1, 2, 3
HEADER = 9  # the counts that open a template's packed array


def _packed(template: ActionNodes, place: dict[str, int], phases: dict) -> np.ndarray:
    """What _wire reads of a template, in one array: its node count and chains' last nodes,
    then the role sets its dependencies and exits refer to (each role as kind and place),
    where each dependency from before it comes from (a set, or -1: the compute chain's last),
    the tensors it makes (places, offsets), its other exits and its merged runs' tails."""
    c = template.compact

    def role(r) -> tuple[int, int]:
        if r[0] == "tensor":
            return TENSOR, place[r[1]]
        if r == COMPUTE_ROLE:
            return COMPUTE, 0
        if r == COMM_ROLE:
            return COMM, 0
        return PREFETCH, phases.setdefault(r[1], len(phases))

    lookups = template._lookups
    index = {roles: s for s, (roles, _) in enumerate(lookups)}
    entries = [role(r) for roles, _ in lookups for r in roles]
    names, offsets, others = template._exits
    other_roles = [role(r) for r, _ in others]
    refs = [(0, ref) if type(ref) is int else (1, index[ref]) for _, ref in others]
    tails, firsts = c.tail_offsets
    none = lambda offset: -1 if offset is None else offset  # noqa: E731
    counts = [len(c.head), none(c.last_compute), none(c.last_comm), len(lookups), len(entries),
              len(c.outside_roles), len(names), len(others), len(tails)]  # HEADER of them
    return np.array([*counts, *(len(roles) for roles, _ in lookups), *(k for k, _ in entries),
                     *(i for _, i in entries), *(-1 if r is _CHAIN else index[r] for r in c.outside_roles),
                     *(place[n] for n in names), *offsets, *(k for k, _ in other_roles), *(i for _, i in other_roles),
                     *(k for k, _ in refs), *(r for _, r in refs), *tails, *firsts], dtype=np.int64)


def wire(builder: _ProgramBuilder) -> bool:
    """Lower `builder`'s stage (timing, with a sibling: _alike_stage) from the sibling's
    templates: its actions' and step's nodes put into builder.replay, their stats counted;
    False (nothing added) if an action has no template there or a role does not resolve as
    it did there -- the stage is then lowered action by action."""
    found, _ = builder.sibling
    place = found.first
    rekeyed: dict[tuple, _Compact] = {}  # by template, virtual stage and kind
    fits = found.wiring.setdefault("fits", {})  # by template: whether its names are the sibling's (every stage asks)

    def choose(key: tuple, present: frozenset, stage: int, kind) -> tuple | None:
        template = found.repeats.get((builder._relative(key), present))
        moves = builder.sibling_moves.get((stage, kind), False)
        if moves is False:
            moves = builder.sibling_moves[stage, kind] = builder._sibling_edges(stage, kind)
        if template is None or not moves:
            return None
        if (fit := fits.get(id(template))) is None:
            fit = fits[id(template)] = template.names <= place.keys()
        if not fit:
            return None
        moved = rekeyed.get(its := (id(template), stage, kind))
        if moved is None:
            moved = rekeyed[its] = template.rekeyed(*moves)
        return moved, template, template

    step = found.step
    if step is None or not step.names <= place.keys():
        return False
    flushed = found.wiring.setdefault("flushed", {})  # (found is the plan's: so are its stages' arrays)
    # (a step moves no send)
    return _wired(builder, choose, (step.compact, step, step), place, found.wiring, flushed, sums=True)


def wire_own(builder: _ProgramBuilder, kept: "StageTemplates") -> bool:
    """Lower `builder`'s stage (timing) from the templates a plan of other sizes lowered it
    with (StageTemplates: the same structure, stage cut, rank and gradient buckets), each
    rebound to this plan's sizes (ActionNodes.rebound); False (nothing added) as wire. The
    templates rebound are the stage's (builder.made, step_template), as if it had run."""
    rebound: dict[int, ActionNodes] = {}

    def bound(template: ActionNodes) -> tuple:
        done = rebound.get(id(template))
        if done is None:
            done = rebound[id(template)] = template.rebound(builder)
        return done.compact, template, done

    def choose(key: tuple, present: frozenset, stage: int, kind) -> tuple | None:
        template = kept.made.get((key, present))
        if template is None:
            return None
        builder.made[key, present] = (found := bound(template))[2]
        return found

    step = bound(kept.step)
    if not _wired(builder, choose, step, kept.place, kept.wiring):
        builder.made.clear()
        return False
    builder.step_template = step[2]
    return True


class StageTemplates:
    """What a stage lowered for timing action by action leaves for the next plan that
    lowers it (stg.lower._ProgramBuilder._built): its templates by action key and chains
    present, its step's, its names as places, and their packed arrays (_packed)."""

    def __init__(self, made: dict, step: ActionNodes) -> None:
        self.made, self.step = made, step
        names = sorted(set().union(*(t.names for t in made.values()), step.names))
        self.place = dict(zip(names, range(len(names))))
        self.wiring: dict = {}


def _wired(builder: _ProgramBuilder, choose: Callable, step: tuple, place: dict[str, int], cache_: dict,
           flushed: dict | None = None, sums: bool = False) -> bool:
    """Wire the stage's actions in schedule order, then the step: `choose(key, chains
    present, virtual stage, kind)` gives an action's (compact form to flush, template whose
    roles and exits it has, template whose stats it adds), or None; `step` the step's. Names
    are `place`'s; `cache_` keeps the templates' packed arrays, `flushed` the repeats' arrays
    of the stages of one plan (flush_arrays); with `sums`, `cache_` also keeps the stats
    their repeats add (a plan's: alike stages repeat the same templates as often). (A stage
    whose actions send gradient buckets is not wired: no key marks a final action.)"""
    m = builder.microbatches
    keys, which, microbatches = _schedule_keys(builder.pipeline.order, builder.rank, builder.apart_runs())
    kept = _templates(cache_, place)
    chosen: dict[int, int] = {}  # key's index -> index into `used`, under the chains present
    used: list[tuple] = []
    order_t = []
    present = frozenset()  # (it only grows: a template chosen under fewer is not chosen again)
    for k in which:
        at = chosen.get(k)
        if at is None:
            key = keys[k]
            found = choose(key, present, key[0], key[1])
            if found is None:
                return False
            at = len(used)
            used.append(found)
            if (sets := _sets(found[1])) <= present:
                chosen[k] = at
            else:
                present, chosen = present | sets, {}
        order_t.append(at)
    used.append(step)
    order_t.append(len(used) - 1)
    order = np.array(order_t, dtype=np.int64)
    # the step reads every micro-batch's tensors, the latest producer of each
    order_mb = np.append(microbatches, m)
    first = np.array([template.microbatch for _, template, _ in used], dtype=np.int64)
    edges = np.array([template.edges for _, template, _ in used], dtype=np.int64)
    shifts = (order_mb - first[order]) * edges[order]
    packed = [kept(template) for _, template, _ in used]
    joined, at, sizes = by_identity(cache_.setdefault("joined", {}), tuple(packed), lambda: (
        np.concatenate(packed), offsets(list(map(len, packed))), np.array([p[0] for p in packed], dtype=np.int64)))
    if "places" not in cache_:  # (`place` is the cache's)
        cache_["places"] = max(place.values(), default=0) + 1
    nodes = int(sizes[order].sum())
    starts, outside, ok = _wire()(joined, at, order, order_mb, m, cache_["places"], max(1, len(cache_["phases"])),
                                   nodes)
    if not ok:
        return False
    builder.nodes.extend([None] * nodes)  # their ids are taken (no node is made)
    counts = tuple(np.bincount(order, minlength=len(used)).tolist())
    stats = tuple(stats_of.stats for _, _, stats_of in used)
    # alike stages repeat the same templates as often: their stats summed once a plan
    builder.repeated(by_identity(cache_.setdefault(("sums", counts), {}) if sums else None, stats,
                                 lambda: _summed(stats, counts)))
    flush_arrays(builder, [compact for compact, _, _ in used], order, starts, shifts, outside, flushed)
    return True


def _summed(stats: tuple[ClassStats, ...], counts: tuple[int, ...]) -> ClassStats:
    """Each of `stats` added its count of times."""
    summed = ClassStats()
    for one, times in zip(stats, counts):
        summed.add(one, times)
    return summed


@lru_cache(maxsize=1024)  # every stage of the few latest plans (a pp 64 plan keys 64)
def _schedule_keys(order: Order, rank: int, apart: frozenset) -> tuple[tuple[tuple, ...], list[int], np.ndarray]:
    """Stage `rank`'s actions of `order` as lowering keys them (_ProgramBuilder._key, no
    action final: none sends buckets; the last micro-batch's apart in the runs `apart`): the
    distinct keys, each action's key by its index, each action's micro-batch. Plans of one
    schedule share them (a pipeline of 64 stages and micro-batches keys 8,192 actions)."""
    keys: dict[tuple, int] = {}
    which, microbatches = [], []
    for action, stage, history in walked(order.stages[rank], rank, order.p):
        key = (stage, action.kind, False, history)
        if key[:2] in apart:
            key += (action.microbatch == order.m - 1,)
        which.append(keys.setdefault(key, len(keys)))
        microbatches.append(action.microbatch)
    return tuple(keys), which, np.array(microbatches, dtype=np.int64)


def _sets(template: ActionNodes) -> frozenset:
    """The chain roles set after `template` ran (ActionNodes.replay sets the chains its nodes
    end and the prefetch points it leaves)."""
    c = template.compact
    added = {role for role, _ in template._exits[2] if role[0] == "prefetch"}
    if c.last_compute is not None:
        added.add(COMPUTE_ROLE)
    if c.last_comm is not None:
        added.add(COMM_ROLE)
    return frozenset(added)


def _templates(cache_: dict, place: dict[str, int]) -> Callable[[ActionNodes], np.ndarray]:
    """Each template's packed arrays (_packed), made once per `cache_`."""
    phases = cache_.setdefault("phases", {})

    def kept(template: ActionNodes) -> np.ndarray:
        packed = cache_.get(id(template))
        if packed is None:
            packed = cache_[id(template)] = _packed(template, place, phases)
        return packed
    return kept


@cache
def _wire():
    """_wire's compiled loop (loading numba is left to the builds that time a plan)."""
    from stg.borrowed_kernel import wired

    return wired
