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
from typing import Callable

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


def _actions(m: int, v: int = 1) -> dict[Kind, list[list[Action]]]:
    """Every action of m micro-batches and v chunks, made once, by kind, chunk and micro-batch:
    a schedule's stages share them (pp x 3mv objects are millions for a long pipeline)."""
    return {kind: [[Action(i, kind, c) for i in range(m)] for c in range(v)] for kind in Kind}


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    a = _actions(m)
    f, b, w = a[Kind.F][0], a[Kind.B][0], a[Kind.W][0]
    return [[*f, *(x for i in range(m) for x in (b[i], w[i]))] for _ in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    a = _actions(m)
    f, b, w = a[Kind.F][0], a[Kind.B][0], a[Kind.W][0]
    stages = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        actions = f[:warmup]
        for i in range(m - warmup):
            actions += (f[warmup + i], b[i], w[i])
        for i in range(m - warmup, m):
            actions += (b[i], w[i])
        stages.append(actions)
    return stages


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    a = _actions(m)
    f, b, w = a[Kind.F][0], a[Kind.B][0], a[Kind.W][0]
    stages = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        actions = f[:warmup]
        deferred = 0  # weight passes run so far
        for i in range(m):
            if warmup + i < m:
                actions.append(f[warmup + i])
            actions.append(b[i])
            if i - deferred >= rank:  # keep `rank` weight passes pending
                actions.append(w[deferred])
                deferred += 1
        actions += w[deferred:]
        stages.append(actions)
    return stages


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's order: virtual micro-batch k runs chunk (k mod pv) div p (counted from the
    last chunk for backwards) of micro-batch (k div pv) p + k mod p."""
    if m % p:
        raise PlanError(f"microbatches={m} must be a multiple of pp={p} for the interleaved schedule")
    total, table = m * v, _actions(m, v)

    def action(k: int, kind: Kind) -> Action:
        chunk = (k % (p * v)) // p
        return table[kind][chunk if kind is Kind.F else v - 1 - chunk][(k // (p * v)) * p + k % p]

    stages = []
    for rank in range(p):
        warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
        actions = [action(k, Kind.F) for k in range(warmup)]
        for k in range(total - warmup):
            actions += (action(warmup + k, Kind.F), action(k, Kind.B), action(k, Kind.W))
        for k in range(total - warmup, total):
            actions += (action(k, Kind.B), action(k, Kind.W))
        stages.append(actions)
    return stages


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}
SPLIT_BACKWARD = {"zb-h1"}  # schedules whose B sends the input gradient before W runs


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if name not in SCHEDULES:
        raise PlanError(f"schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise PlanError(f"vpp={v}: virtual stages need the interleaved schedule, not {name!r}")
    if v == 1 and name == "interleaved":
        raise PlanError("schedule: interleaved runs virtual stages; it needs vpp > 1")
    for field, value, most in (("pp", p, MAX_WORLD), ("microbatches", m, MAX_MICROBATCHES), ("vpp", v, MAX_LAYERS)):
        check_int(field, value, PlanError, maximum=most)
    if p * m * v > MAX_ACTIONS:
        raise PlanError(f"pp*microbatches*vpp = {p * m * v:,} pipeline slots is too many (at most {MAX_ACTIONS:,})")
    return [list(actions) for actions in _made(name, p, m, v)]  # the caller's to change


@functools.lru_cache(maxsize=4)
def _made(name: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """A checked schedule, made once for the plans of a search that share it (a long
    pipeline's holds a million actions)."""
    schedule = SCHEDULES[name](p, m, v)
    check(schedule, p, m, v)
    return tuple(map(tuple, schedule))


def check(schedule: Schedule, p: int, m: int, v: int) -> None:
    """Every stage runs every (micro-batch, kind, chunk) once, F before B before W."""
    order = {Kind.F: 0, Kind.B: 1, Kind.W: 2}
    for rank, actions in enumerate(schedule):
        assert len(actions) == 3 * m * v, rank
        # each action's place in the list, at slot (micro-batch, chunk, kind): no object hashing,
        # this runs over every action of every stage (a million for a long pipeline)
        position = [-1] * (3 * m * v)
        for n, a in enumerate(actions):
            assert 0 <= a.microbatch < m and 0 <= a.chunk < v, (rank, a)
            slot = 3 * (a.microbatch * v + a.chunk) + order[a.kind]
            assert position[slot] < 0, (rank, a)  # runs twice
            position[slot] = n
        # all 3mv slots are filled (as many actions, none twice); F before B before W
        assert all(f < b < w for f, b, w in zip(position[::3], position[1::3], position[2::3])), rank


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    """Chunk c of stage r holds the model's (c p + r)-th slice (Megatron's interleaving)."""
    return chunk * p + rank


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
