"""Communicator group ids: pure arithmetic on the mesh, never a scan over ranks.

ASTRA-sim pairs collectives by group id modulo 500: two groups that share two or more ranks
must not have ids congruent modulo 500, and an id that is a multiple of 500 aliases the
all-ranks group (../shared/reference/chakra-astrasim.md; measured on its analytical backend).

Groups of one kind (the mesh axes they span) are disjoint, so only groups of different kinds
can collide. Small sets (at most 499 groups) take consecutive ids, whose residues are all
different. Larger sets give every kind its own block of residues: group i of a kind whose
block starts at residue lo and holds s residues gets

    id = base + 500 * (i div s) + lo + (i mod s)

so groups of different kinds never share a residue. `base` is a multiple of 500 chosen so
that every id of the set has the same number of digits: every rank of a class then patches
the same byte layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Iterator

from stg.mesh import DeviceMesh
from stg.program import GroupHole

MODULUS = 500


def ordinal_to_id(ordinal: int) -> int:
    """The ordinal-th positive integer that is not a multiple of 500."""
    return ordinal + 1 + ordinal // (MODULUS - 1)


def id_to_ordinal(gid: int) -> int:
    return gid - 1 - gid // MODULUS


def first_ordinal(count: int) -> int:
    """Where to start so that `count` consecutive ids all have the same number of digits."""
    digits = 1
    while True:
        lowest = 10 ** (digits - 1)
        first = id_to_ordinal(lowest + (lowest % MODULUS == 0))  # 1000, 10000, ... are skipped
        if id_to_ordinal(10**digits - 1) - first + 1 >= count:
            return first
        digits += 1


Kind = GroupHole  # a kind of group: the mesh axes it spans (and, maybe, which coordinates)


def _kind(kind) -> Kind:
    return kind if isinstance(kind, GroupHole) else GroupHole(tuple(kind))


@dataclass(frozen=True)
class GroupIds:
    mesh: DeviceMesh
    kinds: tuple[Kind, ...]

    @classmethod
    def for_kinds(cls, mesh: DeviceMesh, kinds: Iterable) -> "GroupIds":
        order = mesh.names
        canonical = sorted({_kind(k) for k in kinds},
                           key=lambda k: (len(k.axes), [order.index(a) for a in k.axes], k.members or ()))
        return cls(mesh, tuple(canonical))

    def groups_of(self, kind) -> int:
        return self.mesh.size // math.prod(self.mesh.sizes[a] for a in _kind(kind).axes)

    @property
    def count(self) -> int:
        return sum(self.groups_of(kind) for kind in self.kinds)

    @cached_property
    def _layout(self) -> tuple[dict, dict, int]:
        """(first ordinal per kind) for small sets, or (residue block per kind, base)."""
        if self.count < MODULUS:
            start, ordinals = first_ordinal(self.count), {}
            for kind in self.kinds:
                ordinals[kind] = start
                start += self.groups_of(kind)
            return ordinals, {}, 0
        share = (MODULUS - 1) // len(self.kinds)
        blocks = {kind: (1 + n * share, share) for n, kind in enumerate(self.kinds)}
        top = max(MODULUS * ((self.groups_of(k) - 1) // s) + lo + s - 1 for k, (lo, s) in blocks.items())
        digits = len(str(top))
        while True:  # the smallest multiple of 500 that gives every id `digits` digits
            base = -(-(10 ** (digits - 1)) // MODULUS) * MODULUS
            if base + top < 10**digits:
                return {}, blocks, base
            digits += 1

    def id_of(self, kind, index: int) -> int:
        kind = _kind(kind)
        ordinals, blocks, base = self._layout
        if ordinals:
            return ordinal_to_id(ordinals[kind] + index)
        lo, share = blocks[kind]
        return base + MODULUS * (index // share) + lo + index % share

    def id(self, rank: int, kind) -> int:
        return self.id_of(kind, self.mesh.group_index(rank, _kind(kind).axes))

    def residues(self, kind) -> set[int]:
        """Every residue modulo 500 that the kind's ids take (arithmetic, no groups built)."""
        kind = _kind(kind)
        ordinals, blocks, _ = self._layout
        if ordinals:
            return {ordinal_to_id(ordinals[kind] + i) % MODULUS for i in range(self.groups_of(kind))}
        lo, share = blocks[kind]
        return set(range(lo, lo + min(share, self.groups_of(kind))))

    def table(self) -> Iterator[tuple[int, list[int]]]:
        """(id, members) of every group: the content of workload.json."""
        for kind in self.kinds:
            for index, members in enumerate(self.mesh.groups(kind.axes)):
                yield self.id_of(kind, index), self._keep(kind, members)

    def members(self, rank: int, kind) -> list[int]:
        """The members of `rank`'s group of `kind`, as workload.json lists them."""
        kind = _kind(kind)
        return self._keep(kind, self.mesh.group(rank, kind.axes))

    def span(self, rank: int, kind) -> tuple[int, int, int]:
        """The size, lowest and highest rank of `members(rank, kind)`, without listing them (a
        dp group of a wide plan holds hundreds of ranks; a network costs a group by these)."""
        kind = _kind(kind)
        return self.mesh.group_span(rank, kind.axes, kind.members)

    def _keep(self, kind: Kind, members: list[int]) -> list[int]:
        if kind.members is None:
            return members
        stride, size = self.mesh.stride(kind.axes[0]), self.mesh.sizes[kind.axes[0]]
        return [r for r in members if (r // stride) % size in kind.members]
