"""Embedding-table sharding, in TorchRec's vocabulary, as layouts of table groups.

The ranks of a recommendation model are data parallel (mesh axes dp x local: hosts x ranks
per host); every table is sharded one of five ways, and the tables of one kind form one
group, looked up by one kernel per rank and exchanged by one collective per direction
(TorchRec's grouping by sharding type). What each kind asks of the layouts:

  data_parallel   the table replicated; ids stay with their samples; the dense table
                  gradient comes out Partial and is ALL_REDUCED (with the dense gradients).
  row_wise        rows split over all ranks: the ids must go to their rows' ranks, Shard(batch)
                  -> Shard(ids), an ALL_TO_ALL (the input distribution); each rank pools the
                  ids it holds for the whole batch, a partial sum, REDUCE_SCATTERED to the
                  batch owners; backward: the pooled gradient ALL_GATHERED.
  table_wise      every rank a slot holding whole tables of its own, stacked by rows: the ids
                  go to their table's slot (ALL_TO_ALL), the slot pools its features for the
                  whole batch, and Shard(features) -> Shard(batch) is an ALL_TO_ALL;
                  backward: the same all-to-all back.
  column_wise     tables split into column shards placed like tables in slots.
  table_row_wise  a host a slot: tables placed per host, rows split over its ranks: one
                  ALL_TO_ALL of ids over all ranks, a REDUCE_SCATTER inside the host, an
                  ALL_TO_ALL across hosts (TorchRec's TWRW).

The sharded tables are updated in the backward by the fused row-wise Adagrad kernel (only the
touched rows); data-parallel tables get a dense gradient and a row-wise Adagrad step.

Slots hold different tables, so their ranks differ: a slot's rows, ids and features are bound
per rank class, and the collectives are sized by the widest slot (an all-to-all is even in
Chakra; TorchRec's is uneven). Every rank then receives what the busiest really receives: the
all-to-all lasts as long as the real one where ports run in parallel, and its total bytes are
overstated by `EmbeddingPlan.padding()`'s factor. The automatic planner is greedy
(TorchRec's planner, simplified): tables that move fewer bytes replicated than sharded are data
parallel; the others, largest first, go table-wise to the least-loaded rank with room, else
table-row-wise to a host with room, else row-wise; none may take a rank past the memory
limit, and a table that fits nowhere is a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import sympy

from model_zoo.dlrm import DLRMConfig, TableGroup
from stg.errors import PlanError
from stg.graph import DType
from stg.mesh import axis_symbol

STATE_BYTES = 4  # row-wise Adagrad: one fp32 per row
MIN_COLUMN_WIDTH = 32  # column_wise splits a table into shards at least this wide, by default


class Sharding(Enum):
    DATA_PARALLEL = ("data_parallel", "dp")
    TABLE_WISE = ("table_wise", "tw")
    COLUMN_WISE = ("column_wise", "cw")
    ROW_WISE = ("row_wise", "rw")
    TABLE_ROW_WISE = ("table_row_wise", "twrw")

    def __init__(self, label: str, short: str):
        self.label = label
        self.short = short

    @classmethod
    def parse(cls, text: str, where: str) -> "Sharding":
        for member in cls:
            if text == member.label:
                return member
        raise PlanError(f"{where}: unknown embedding sharding {text!r}; known: "
                        f"{', '.join(m.label for m in cls)}, auto")

    @property
    def slot_axes(self) -> tuple[str, ...]:
        """Mesh axes whose coordinates number the slots (the ranks that hold their own tables)."""
        return {Sharding.TABLE_WISE: ("dp", "local"), Sharding.COLUMN_WISE: ("dp", "local"),
                Sharding.TABLE_ROW_WISE: ("dp",)}.get(self, ())


@dataclass(frozen=True)
class Placement:
    table: int
    sharding: Sharding
    slots: tuple[int, ...] = ()  # per column shard (one for table-wise), or the host (table_row_wise)


@dataclass(frozen=True)
class EmbeddingPlan:
    config: DLRMConfig
    placements: tuple[Placement, ...]  # in table order
    hosts: int  # the dp axis
    local: int  # ranks per host
    columns: int  # column shards per column-wise table
    batch: int  # samples per micro-batch over all ranks

    @property
    def world(self) -> int:
        return self.hosts * self.local

    def slot_count(self, sharding: Sharding) -> int:
        return math.prod({"dp": self.hosts, "local": self.local}[a] for a in sharding.slot_axes)

    @cached_property
    def _groups(self) -> dict[Sharding, TableGroup]:
        """One group per sharding type in use: its tables, stacked in slots if it has them."""
        groups = {}
        for sharding in Sharding:
            tables = tuple(p.table for p in self.placements if p.sharding is sharding)
            if tables:
                slots = sympy.Mul(*(axis_symbol(a) for a in sharding.slot_axes))
                columns = self.columns if sharding is Sharding.COLUMN_WISE else 1
                groups[sharding] = TableGroup(sharding.short, tables, slots, columns,
                                              fused=sharding is not Sharding.DATA_PARALLEL)
        return groups

    @property
    def groups(self) -> tuple[TableGroup, ...]:
        """The table groups the model's graph is built with (model_zoo/dlrm.py)."""
        return tuple(self._groups.values())

    def slot_shards(self, sharding: Sharding) -> list[list[int]]:
        """Per slot, the tables of its shards (a column-wise table once per shard it holds)."""
        shards: list[list[int]] = [[] for _ in range(self.slot_count(sharding))]
        for p in self.placements:
            if p.sharding is sharding:
                for slot in p.slots:
                    shards[slot].append(p.table)
        return shards

    @cached_property
    def _slot_sizes(self) -> dict[Sharding, list[dict]]:
        """Per slotted sharding, per slot: its symbols' values (slots with the same shards
        share one dict)."""
        result = {}
        for sharding, group in self._groups.items():
            if not sharding.slot_axes:
                continue
            known: dict[tuple, dict] = {}
            slots = [tuple(shards) for shards in self.slot_shards(sharding)]
            for shards in slots:
                if shards not in known:
                    known[shards] = group.sizes(self.config.tables, shards, self.row_split(sharding))
            result[sharding] = [known[shards] for shards in slots]
        return result

    def row_split(self, sharding: Sharding) -> int:
        """Over how many ranks a table's rows are split (its rows padded to a multiple)."""
        return {Sharding.ROW_WISE: self.world, Sharding.TABLE_ROW_WISE: self.local}.get(sharding, 1)

    def bindings(self) -> dict[sympy.Symbol, Any]:
        """Values of the groups' symbols common to every rank: group totals, and for slotted
        groups the widest slot (what the collectives are padded to)."""
        values: dict[sympy.Symbol, Any] = {}
        for sharding, group in self._groups.items():
            if sharding in self._slot_sizes:
                distinct = {id(slot): slot for slot in self._slot_sizes[sharding]}.values()
                for symbol in group.symbols:
                    values[symbol] = max(slot[symbol] for slot in distinct)
            else:
                values.update(group.sizes(self.config.tables, row_multiple=self.row_split(sharding)))
        return values

    @property
    def variant_axes(self) -> tuple[str, ...]:
        """Mesh axes whose coordinates decide which tables a rank holds."""
        axes = {a for s in self._slot_sizes for a in s.slot_axes}
        return tuple(a for a in ("dp", "local") if a in axes)

    @cached_property
    def variants(self) -> tuple[tuple[dict, ...], tuple[int, ...]]:
        """(the distinct per-rank bindings, and for each coordinate on variant_axes -- mixed
        radix, dp slowest -- the index of its bindings). Ranks whose slots hold the same loads
        share a rank class."""
        sizes = {"dp": self.hosts, "local": self.local}
        axes = self.variant_axes
        # a slot's values as a hashable key, once per distinct dict
        keys = {id(slot): tuple(slot.values()) for per_slot in self._slot_sizes.values() for slot in per_slot}
        found: dict[tuple, int] = {}
        distinct: list[dict] = []
        index = []
        for flat in range(math.prod(sizes[a] for a in axes)):
            coords, rest = {}, flat
            for axis in reversed(axes):
                rest, coords[axis] = divmod(rest, sizes[axis])
            slots = []
            for sharding, per_slot in self._slot_sizes.items():
                slot = 0
                for axis in sharding.slot_axes:
                    slot = slot * sizes[axis] + coords[axis]
                slots.append(per_slot[slot])
            key = tuple(keys[id(slot)] for slot in slots)
            if key not in found:
                found[key] = len(distinct)
                distinct.append({k: v for slot in slots for k, v in slot.items()})
            index.append(found[key])
        return tuple(distinct), tuple(index)

    def padding(self) -> dict[str, dict]:
        """Per slotted sharding type: the slots' pooled features and ids per sample, most and
        mean. Its all-to-alls are sized by the most (Chakra's ALL_TO_ALL is even; TorchRec's
        is not): most / mean is how much they overstate the traffic."""
        result = {}
        for sharding, per_slot in self._slot_sizes.items():
            _, ids, features = self._groups[sharding].symbols
            entry = {"slots": len(per_slot)}
            for label, symbol in (("features", features), ("ids", ids)):
                values = [float(slot[symbol]) for slot in per_slot]
                mean = sum(values) / len(values)
                entry[label] = {"most": max(values), "mean": mean, "overstatement": max(values) / mean}
            result[sharding.label] = entry
        return result

    # -- what a rank holds --------------------------------------------------------------------
    def shard_bytes(self, placement: Placement) -> tuple[int, int]:
        """(weights, optimizer state) bytes of one shard of the placement on one rank."""
        table = self.config.tables[placement.table]
        width = self.config.embedding_dim // (self.columns if placement.sharding is Sharding.COLUMN_WISE else 1)
        rows = -(-table.rows // self.row_split(placement.sharding))
        return rows * width * self.weight_bytes, rows * STATE_BYTES

    @property
    def weight_bytes(self) -> int:
        return DType.parse(self.config.embedding_dtype).nbytes

    def rank_memory(self, rank: int) -> dict[str, int]:
        """Embedding weights, optimizer states and (data parallel) dense gradients on `rank`."""
        host = rank // self.local
        weights = states = grads = 0
        for p in self.placements:
            copies = {Sharding.DATA_PARALLEL: 1, Sharding.ROW_WISE: 1,
                      Sharding.TABLE_ROW_WISE: int(host in p.slots)}.get(p.sharding, p.slots.count(rank))
            w, s = self.shard_bytes(p)
            weights += copies * w
            states += copies * s
            if p.sharding is Sharding.DATA_PARALLEL:
                grads += w
        return {"weights": weights, "optimizer_states": states, "gradients": grads}

    def table(self) -> list[dict]:
        """One row per table: what the plan did with it (`stg plan-embeddings`, summary.json)."""
        rows = []
        for p in self.placements:
            t = self.config.tables[p.table]
            w, s = self.shard_bytes(p)
            where = {Sharding.DATA_PARALLEL: "all", Sharding.ROW_WISE: "all"}.get(p.sharding)
            if where is None:
                prefix = "host " if p.sharding is Sharding.TABLE_ROW_WISE else "rank "
                where = ", ".join(prefix + str(x) for x in p.slots)
            rows.append({"table": t.name, "rows": t.rows, "dim": self.config.embedding_dim,
                         "pooling": float(t.pooling), "sharding": p.sharding.label, "placed_on": where,
                         "shard_bytes": w + s,
                         "lookup_bytes": int(self.batch * t.pooling * self.config.embedding_dim * self.weight_bytes)})
        return rows


def rules(plan) -> dict[str, dict[str, tuple[str, ...]]]:
    """Logical-axis rules of the table groups (model_zoo/dlrm.py names their axes)."""
    world = ("dp", "local")
    params = {f"{s.short}.rows": world for s in Sharding if s is not Sharding.DATA_PARALLEL}
    pooled = {f"{s.short}.features": s.slot_axes for s in Sharding if s.slot_axes}
    return {"params": params, "pooled": pooled}


def plan_embeddings(config: DLRMConfig, *, default: str | None, overrides: Mapping[str, Any] | None, hosts: int,
                    local: int, batch: int, limit_bytes: int, columns: int | None = None) -> EmbeddingPlan:
    """Every table's sharding and placement: `overrides` (table name -> a sharding, or
    {sharding, ranks | host}) first, then `default` for the rest (a sharding, or "auto")."""
    world = hosts * local
    d = config.embedding_dim
    columns = columns or max(1, min(world, d // MIN_COLUMN_WIDTH))
    if d % columns:
        raise PlanError(f"column_shards={columns} does not divide the embedding dim {d}")
    names = {t.name: i for i, t in enumerate(config.tables)}
    unknown = sorted(set(overrides or {}) - set(names))
    if unknown:
        raise PlanError(f"embeddings: unknown table(s) {unknown}; the model's tables: {', '.join(names)}")
    empty = EmbeddingPlan(config, (), hosts, local, columns, batch)
    largest_first = sorted(range(len(config.tables)), key=lambda i: (-config.tables[i].rows, i))

    def propose(choose) -> EmbeddingPlan:
        planner = _Planner(empty, limit_bytes)
        for name, spec in (overrides or {}).items():
            planner.place_explicit(names[name], spec)
        for i in largest_first:
            if i not in planner.placed:
                choose(planner, i)
        return replace(empty, placements=tuple(sorted(planner.placed.values(), key=lambda p: p.table)))

    if (default or "auto") != "auto":
        chosen = Sharding.parse(default, "embedding_sharding")
        return propose(lambda planner, i: planner.place(i, chosen))
    # proposals from the least traffic to the most even memory; the first that fits wins.
    # The last spreads every table over all ranks: if it does not fit, nothing does.
    for kinds in AUTO_PROPOSALS[:-1]:
        try:
            return propose(lambda planner, i: planner.place_auto(i, kinds))
        except PlanError:
            continue
    return propose(lambda planner, i: planner.place_auto(i, AUTO_PROPOSALS[-1]))


AUTO_PROPOSALS = (
    # whole tables where they fit, else column shards (the same traffic as whole tables), else
    # rows over a host, else over every rank (each rank reduce-scatters the whole batch's
    # partial sums: the most traffic)
    (Sharding.DATA_PARALLEL, Sharding.TABLE_WISE, Sharding.COLUMN_WISE, Sharding.TABLE_ROW_WISE, Sharding.ROW_WISE),
    (Sharding.DATA_PARALLEL, Sharding.TABLE_ROW_WISE, Sharding.ROW_WISE),
    (Sharding.ROW_WISE,),
)


class _Planner:
    """Greedy placement under a per-rank memory limit. A rank's fullness is its share of all
    lookup bytes plus its share of all table bytes, balancing both (as TorchRec's planner
    balances time and storage)."""

    def __init__(self, plan: EmbeddingPlan, limit: int):
        self.plan = plan
        self.limit = limit
        self.used = np.zeros(plan.world, dtype=np.int64)
        self.load = np.zeros(plan.world)
        self.placed: dict[int, Placement] = {}
        # what all tables would add, replicated once: the scales that make bytes and loads comparable
        whole = [self._cost(Placement(t, Sharding.TABLE_WISE)) for t in range(len(plan.config.tables))]
        self.total_bytes = sum(size for size, _ in whole) or 1
        self.total_load = sum(load for _, load in whole) or 1

    def _cost(self, p: Placement) -> tuple[int, float]:
        """(bytes, lookup bytes per step) that one shard adds to each rank holding part of it."""
        w, s = self.plan.shard_bytes(p)
        grad = w if p.sharding is Sharding.DATA_PARALLEL else 0
        table = self.plan.config.tables[p.table]
        load = self.plan.batch * float(table.pooling) * self.plan.config.embedding_dim * self.plan.weight_bytes
        columns = self.plan.columns if p.sharding is Sharding.COLUMN_WISE else 1
        # replicated tables look up each rank's own samples; row-wise ones a share of every id
        spread = self.plan.world if p.sharding is Sharding.DATA_PARALLEL else self.plan.row_split(p.sharding)
        return w + s + grad, load / columns / spread

    def _by_slot(self, values: np.ndarray, sharding: Sharding) -> np.ndarray:
        """Per slot, the largest value over its ranks (a host's ranks for table_row_wise)."""
        return values.reshape(self.plan.hosts, self.plan.local).max(axis=1) if sharding is Sharding.TABLE_ROW_WISE else values

    def _ranks(self, sharding: Sharding, slot: int) -> slice:
        if sharding is Sharding.TABLE_ROW_WISE:
            return slice(slot * self.plan.local, (slot + 1) * self.plan.local)
        return slice(slot, slot + 1) if sharding.slot_axes else slice(None)

    def try_place(self, table: int, sharding: Sharding, slots: Sequence[int] | None = None) -> bool:
        """Place the table's shards one by one on the least-full slot with room (or on
        `slots`); False, and nothing placed, if one does not fit."""
        size, load = self._cost(Placement(table, sharding))
        if not sharding.slot_axes:
            if self.used.max() + size > self.limit:
                return False
            self.used += size
            self.load += load
            self.placed[table] = Placement(table, sharding)
            return True
        saved = self.used.copy(), self.load.copy()
        chosen: list[int] = []
        for k in range(self.plan.columns if sharding is Sharding.COLUMN_WISE else 1):
            fullness = self._by_slot(self.load / self.total_load + self.used / self.total_bytes, sharding)
            fullness[self._by_slot(self.used, sharding) + size > self.limit] = np.inf
            fullness[chosen] = np.inf  # a table's column shards go to different slots
            slot = slots[k] if slots is not None else int(np.argmin(fullness))  # lowest slot on ties
            if not np.isfinite(fullness[slot]):
                self.used, self.load = saved
                return False
            chosen.append(slot)
            self.used[self._ranks(sharding, slot)] += size
            self.load[self._ranks(sharding, slot)] += load
        self.placed[table] = Placement(table, sharding, tuple(chosen))
        return True

    def place(self, table: int, sharding: Sharding, slots: Sequence[int] | None = None) -> None:
        if sharding is Sharding.TABLE_ROW_WISE and self.plan.local == 1:
            raise PlanError(f"table {self.plan.config.tables[table].name}: table_row_wise splits rows over the "
                            "ranks of a host: set local_world_size > 1")
        if not self.try_place(table, sharding, slots):
            raise self._no_room(table, [sharding])

    def place_auto(self, table: int, kinds: Sequence[Sharding]) -> None:
        """The first of `kinds` that fits. Replicated, a table's gradient is all-reduced: ~2 x
        rows x dim moved per rank; sharded, the batch's pooled vectors go out and their
        gradients come back: ~2 x batch x dim. So only tables with no more rows than the
        batch has samples are replicated."""
        usable = [k for k in kinds if (k is not Sharding.COLUMN_WISE or self.plan.columns > 1)
                  and (k is not Sharding.TABLE_ROW_WISE or self.plan.local > 1)
                  and (k is not Sharding.DATA_PARALLEL or self.plan.config.tables[table].rows <= self.plan.batch)]
        for sharding in usable:
            if self.try_place(table, sharding):
                return
        raise self._no_room(table, [k for k in usable if k is not Sharding.DATA_PARALLEL] or usable)

    def place_explicit(self, table: int, spec: Any) -> None:
        name = self.plan.config.tables[table].name
        where = f"embeddings: {name}"
        if isinstance(spec, str):
            spec = {"sharding": spec}
        if not isinstance(spec, Mapping) or "sharding" not in spec:
            raise PlanError(f"{where}: expected a sharding name or {{sharding, ranks | host}}, got {spec!r}")
        unknown = sorted(set(spec) - {"sharding", "ranks", "host"})
        if unknown:
            raise PlanError(f"{where}: unknown key(s) {unknown}; known: sharding, ranks, host")
        sharding = Sharding.parse(spec["sharding"], where)
        slots = spec.get("ranks", [spec["host"]] if "host" in spec else None)
        if slots is not None:
            slots = [slots] if isinstance(slots, int) else list(slots)
            limit = self.plan.hosts if sharding is Sharding.TABLE_ROW_WISE else self.plan.world
            key = "host" if sharding is Sharding.TABLE_ROW_WISE else "ranks"
            if not sharding.slot_axes:
                raise PlanError(f"{where}: {sharding.label} spreads over every rank; it takes no {key}")
            bad = [s for s in slots if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < limit]
            if bad:
                raise PlanError(f"{where}: {key} {bad} out of range 0..{limit - 1}")
            need = self.plan.columns if sharding is Sharding.COLUMN_WISE else 1
            if len(slots) != need or len(set(slots)) != need:
                raise PlanError(f"{where}: {sharding.label} needs {need} distinct {key}, got {slots}")
        self.place(table, sharding, slots)

    def _no_room(self, table: int, tried: list[Sharding]) -> PlanError:
        t = self.plan.config.tables[table]
        needs = []
        for sharding in tried:
            size, _ = self._cost(Placement(table, sharding))
            needs.append(f"{sharding.label} {size / 2**30:.2f} GiB")
        free = (self.limit - int(self.used.max())) / 2**30
        return PlanError(
            f"embedding table {t.name} ({t.rows:,} rows x {self.plan.config.embedding_dim}) fits on no rank under "
            f"the {self.limit / 2**30:.2f} GiB per-rank embedding memory limit (per rank it needs: "
            f"{', '.join(needs)}; the fullest rank has {free:.2f} GiB left): raise embedding_memory_gib or use "
            f"more ranks")
