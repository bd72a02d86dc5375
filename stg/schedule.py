"""Pipeline schedules as data: per stage, the ordered list of actions it runs.

An Action is (micro-batch, kind, chunk) and prints as `3F1`: micro-batch 3, forward, chunk 1.
Kinds: F forward, B input-gradient backward, W weight-gradient backward. Schedules without a
split backward run each B immediately followed by its W, and the input gradient leaves for
the previous stage only after both (one autograd backward call); only zb-h1 sends it after B.
A schedule is a pure function of
(stages p, micro-batches m, chunks per stage v); `grid` prints it step by step; `simulate`
runs it with given action costs and free communication and reports the makespan.

  gpipe        all forwards, then all backwards (Huang et al. 2019)
  1f1b         PipeDream-Flush (Narayanan et al. 2019): stage r warms up with p - r - 1
               forwards, then alternates one forward and one backward, then drains
  interleaved  Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v chunks per stage,
               micro-batches in groups of p per chunk, warm-up 2(p - r - 1) + (v - 1)p
  zb-h1        Qi et al. 2024, ZB-H1: 1F1B with the backward split; stage r defers its W
               passes by r micro-batches, so every stage holds p micro-batches in flight (the
               first stage's count under 1F1B) and the W passes fill the drain's bubbles
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

from stg.errors import PlanError
from stg.graph import FastEnum
from stg.limits import MAX_LAYERS, MAX_MICROBATCHES, MAX_WORLD, check_int

MAX_ACTIONS = 2**20  # (micro-batch, chunk) slots over all stages: 3 actions each, held as objects


class Kind(FastEnum):
    F = "F"
    B = "B"
    W = "W"


@dataclass(frozen=True)
class Action:
    microbatch: int
    kind: Kind
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.microbatch}{self.kind.value}{self.chunk}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = re.fullmatch(r"(\d+)([FBW])(\d+)", text)
        if not match:
            raise ValueError(f"not an action: {text!r} (expected e.g. 3F1)")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


Schedule = list[list[Action]]  # per stage

# A schedule is made as arrays: per stage, the slot of each action in order, slot
# 3 (i v + c) + k for micro-batch i, chunk c and kind k (F 0, B 1, W 2). A long pipeline's
# holds a million actions; its Action objects are looked up only where they are used.
_KINDS = (Kind.F, Kind.B, Kind.W)
Slots = list[np.ndarray]  # per stage


def _one_forward_one_backward(forwards: np.ndarray, backwards: np.ndarray, warmup: int) -> np.ndarray:
    """Slots of `warmup` forwards, then one forward and one backward at a time, then the
    remaining backwards: the forward and the B slots in the order they run, each W right
    after its B."""
    n = len(forwards)
    steady = np.stack([forwards[warmup:], backwards[:n - warmup], backwards[:n - warmup] + 1], axis=1)
    drain = np.stack([backwards[n - warmup:], backwards[n - warmup:] + 1], axis=1)
    return np.concatenate([forwards[:warmup], steady.ravel(), drain.ravel()])


def gpipe(p: int, m: int, v: int = 1) -> Slots:
    forwards = 3 * np.arange(m)
    return [_one_forward_one_backward(forwards, forwards + 1, m)] * p


def one_f_one_b(p: int, m: int, v: int = 1) -> Slots:
    forwards = 3 * np.arange(m)
    return [_one_forward_one_backward(forwards, forwards + 1, min(p - rank - 1, m)) for rank in range(p)]


def zb_h1(p: int, m: int, v: int = 1) -> Slots:
    stages = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        slots = [3 * i for i in range(warmup)]
        deferred = 0  # weight passes run so far
        for i in range(m):
            if warmup + i < m:
                slots.append(3 * (warmup + i))
            slots.append(3 * i + 1)
            if i - deferred >= rank:  # keep `rank` weight passes pending
                slots.append(3 * deferred + 2)
                deferred += 1
        slots += [3 * i + 2 for i in range(deferred, m)]
        stages.append(np.array(slots, dtype=np.int64))
    return stages


def interleaved(p: int, m: int, v: int) -> Slots:
    """Megatron's order: virtual micro-batch k runs chunk (k mod pv) div p (counted from the
    last chunk for backwards) of micro-batch (k div pv) p + k mod p (m a multiple of p: order)."""
    k = np.arange(m * v)  # virtual micro-batches
    chunk, microbatch = (k % (p * v)) // p, (k // (p * v)) * p + k % p
    forwards, backwards = 3 * (microbatch * v + chunk), 3 * (microbatch * v + v - 1 - chunk) + 1
    warmup = lambda rank: len(k) if m == p else min((p - rank - 1) * 2 + (v - 1) * p, len(k))  # noqa: E731
    return [_one_forward_one_backward(forwards, backwards, warmup(rank)) for rank in range(p)]


SCHEDULES: dict[str, Callable[[int, int, int], Slots]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}
SPLIT_BACKWARD = {"zb-h1"}  # schedules whose B sends the input gradient before W runs


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    return [list(actions) for actions in order(name, p, m, v).stages]  # the caller's to change


def order(name: str, p: int, m: int, v: int = 1) -> "Order":
    """The schedule `name` of p stages, m micro-batches and v chunks a stage, checked, its
    actions not yet made."""
    if name not in SCHEDULES:
        raise PlanError(f"schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise PlanError(f"vpp={v}: virtual stages need the interleaved schedule, not {name!r}")
    if v == 1 and name == "interleaved":
        raise PlanError("schedule: interleaved runs virtual stages; it needs vpp > 1")
    if name == "interleaved" and m % p:
        raise PlanError(f"microbatches={m} must be a multiple of pp={p} for the interleaved schedule")
    for field, value, most in (("pp", p, MAX_WORLD), ("microbatches", m, MAX_MICROBATCHES), ("vpp", v, MAX_LAYERS)):
        check_int(field, value, PlanError, maximum=most)
    if p * m * v > MAX_ACTIONS:
        raise PlanError(f"pp*microbatches*vpp = {p * m * v:,} pipeline slots is too many (at most {MAX_ACTIONS:,})")
    return Order(name, p, m, v)


@dataclass(frozen=True)
class Order:
    """A schedule by its name and sizes (made by `order`, which checks them). Its actions and
    its stages' digests are made on first use, once for the plans of a search that share
    them: a long pipeline's schedule holds a million actions, and a plan counted without
    nodes needs only the digests."""

    name: str
    p: int
    m: int
    v: int = 1

    @property
    def stages(self) -> tuple[tuple[Action, ...], ...]:
        return _made(self)

    def digest(self, rank: int) -> "StageDigest":
        return _digests(self)[rank]


@functools.lru_cache(maxsize=4)
def _slots(order: Order) -> tuple[np.ndarray, ...]:
    """A schedule's slots, checked."""
    stages = SCHEDULES[order.name](order.p, order.m, order.v)
    check(stages, order.p, order.m, order.v)
    return tuple(stages)


@functools.lru_cache(maxsize=4)
def _made(order: Order) -> tuple[tuple[Action, ...], ...]:
    """A schedule's actions, its stages sharing one Action object per slot."""
    table = [Action(i, kind, c) for i in range(order.m) for c in range(order.v) for kind in _KINDS]
    return tuple(tuple(map(table.__getitem__, slots.tolist())) for slots in _slots(order))


@dataclass(frozen=True)
class StageDigest:
    """What counting a stage's work and its activation peak need of its list of actions.

    `finals`: the last action of each chunk and kind (it sends the gradient buckets its ops
    finish). `walks`: its micro-batches grouped by what they run -- the (chunk, kind) of each
    of their actions in order, and which of those are finals --, each as (the first such
    micro-batch's actions, those lasts, how many micro-batches).
    `in_flight`: per chunk c, the forwards run less the input-gradient passes run (entry 2c)
    and those less the weight-gradient passes run (2c + 1), at the points of the list where
    the bytes held can peak. Those bytes are the sum over chunks of the chunk's saved bytes
    times entry 2c and the bytes its W passes read times entry 2c + 1 (stg/memory.py): a sum
    with weights >= 0, so its peak is at a point that no other exceeds in every entry."""

    finals: frozenset[Action]
    walks: tuple[tuple[tuple[Action, ...], tuple[bool, ...], int], ...]
    in_flight: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, slots: np.ndarray, v: int) -> "StageDigest":
        """From a stage's slots (a long pipeline's stage runs 10^4-10^5 actions)."""
        kinds, chunks, microbatches = slots % 3, slots // 3 % v, slots // (3 * v)
        code = slots % (3 * v)  # chunk and kind
        last = np.zeros(len(slots), dtype=bool)  # the last action of each chunk and kind
        _, from_end = np.unique(code[::-1], return_index=True)
        last[len(slots) - 1 - from_end] = True
        # every micro-batch runs each (chunk, kind) once (check): a row of 3v actions each
        by_microbatch = np.argsort(microbatches, kind="stable")
        rows = (2 * code + last)[by_microbatch].reshape(-1, 3 * v)
        found: dict[bytes, list] = {}  # a distinct row -> [its first micro-batch, how many]
        starts = np.flatnonzero(np.r_[True, (rows[1:] != rows[:-1]).any(axis=1)])  # runs of equal rows
        for start, end in zip(starts.tolist(), [*starts[1:].tolist(), len(rows)]):
            found.setdefault(rows[start].tobytes(), [start, 0])[1] += end - start
        walks = []
        for row, n in found.values():
            taken = by_microbatch[row * 3 * v:(row + 1) * 3 * v]
            actions = tuple(Action(row, _KINDS[k], c) for k, c in zip(kinds[taken].tolist(), chunks[taken].tolist()))
            walks.append((actions, tuple(last[taken].tolist()), n))
        # entries 2c and 2c + 1 change by F: (+1, 0), B: (-1, +1), W: (0, -1) on chunk c
        steps = np.zeros((len(slots), 2 * v), dtype=np.int64)
        at = np.arange(len(slots))
        steps[at, 2 * chunks] = (kinds == 0).astype(np.int64) - (kinds == 1)
        steps[at, 2 * chunks + 1] = (kinds == 1).astype(np.int64) - (kinds == 2)
        # a forward is the only action that adds bytes (a B frees at least what it keeps for W)
        points = np.vstack([np.zeros((1, 2 * v), np.int64), steps.cumsum(axis=0)[kinds == 0]])
        maximal: list[tuple[int, ...]] = []
        while len(points):  # a point of greatest sum is maximal; drop it and what it exceeds
            best = points[points.sum(axis=1).argmax()]
            maximal.append(tuple(best.tolist()))
            points = points[~(points <= best).all(axis=1)]
        finals = frozenset(Action(i, _KINDS[k], c) for i, k, c in
                           zip(microbatches[last].tolist(), kinds[last].tolist(), chunks[last].tolist()))
        return cls(finals, tuple(walks), tuple(maximal))


@functools.lru_cache(maxsize=64)
def _digests(order: Order) -> tuple[StageDigest, ...]:
    return tuple(StageDigest.of(slots, order.v) for slots in _slots(order))


def check(schedule: Slots, p: int, m: int, v: int) -> None:
    """Every stage runs every (micro-batch, kind, chunk) once, F before B before W."""
    for rank, slots in enumerate(schedule):
        assert len(slots) == 3 * m * v and ((0 <= slots) & (slots < 3 * m * v)).all(), rank
        assert (np.bincount(slots, minlength=3 * m * v) == 1).all(), rank  # each slot once
        position = np.empty(3 * m * v, dtype=np.int64)
        position[slots] = np.arange(len(slots))
        f, b, w = position.reshape(-1, 3).T
        assert ((f < b) & (b < w)).all(), rank


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    """Chunk c of stage r holds the model's (c p + r)-th slice (Megatron's interleaving)."""
    return chunk * p + rank


def walked(actions: Iterable[Action], rank: int, p: int) -> Iterator[tuple[Action, int, tuple]]:
    """Each of stage `rank`'s actions with its virtual stage and the (virtual stage, kind) of
    its micro-batch's actions before it: what the tensors it finds made depend on (lowering
    keys an action by them)."""
    history: dict[int, tuple] = {}
    for action in actions:
        stage = virtual_stage(rank, action.chunk, p)
        before = history.get(action.microbatch, ())
        history[action.microbatch] = before + ((stage, action.kind),)
        yield action, stage, before


def simulate(schedule: Schedule, cost: Callable[[Action], float], v: int = 1,
             split_backward: bool = False) -> tuple[float, list[float]]:
    """Run every stage's list in order with free communication: F of a slice waits for F of the
    slice before it, B for the backward of the slice after it (its B if the backward is split,
    else its W), W for B of its own. Returns the makespan and each stage's busy time."""
    upstream = "B" if split_backward else "W"
    p = len(schedule)
    last = p * v - 1
    done: dict[tuple, float] = {}
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while position[rank] < len(schedule[rank]):
                a = schedule[rank][position[rank]]
                vs = virtual_stage(rank, a.chunk, p)
                if a.kind is Kind.F:
                    need = [("F", a.microbatch, vs - 1)] if vs > 0 else []
                elif a.kind is Kind.B:
                    need = [("F", a.microbatch, vs)] + ([(upstream, a.microbatch, vs + 1)] if vs < last else [])
                else:
                    need = [("B", a.microbatch, vs)]
                if any(n not in done for n in need):
                    break
                start = max([clock[rank], *(done[n] for n in need)])
                clock[rank] = start + cost(a)
                busy[rank] += cost(a)
                done[(a.kind.value, a.microbatch, vs)] = clock[rank]
                position[rank] += 1
                progress = True
    if any(position[r] < len(schedule[r]) for r in range(p)):
        stuck = {r: str(schedule[r][position[r]]) for r in range(p) if position[r] < len(schedule[r])}
        raise AssertionError(f"schedule deadlocks: stages wait at {stuck}")
    return max(clock), busy


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batch chunks whose activations a stage holds at once: from a forward until
    its weight-gradient pass (the last that reads them)."""
    held = peak = 0
    for a in actions:
        held += {Kind.F: 1, Kind.B: 0, Kind.W: -1}[a.kind]
        peak = max(peak, held)
    return peak


def grid(schedule: Schedule) -> str:
    """One row per stage, one column per step, the way pipeline papers draw schedules."""
    width = max(len(str(a)) for actions in schedule for a in actions)
    return "\n".join(
        f"stage {rank:>2}: " + " ".join(f"{str(a):>{width}}" for a in actions) for rank, actions in enumerate(schedule)
    )
