"""Communicator group ids: pure arithmetic on the mesh, never a scan over ranks.

Groups of one kind (the mesh axes they span) get consecutive ordinals; kinds follow one
another in a fixed order. Ordinals map to ids that skip every multiple of 500: ASTRA-sim
pairs collectives by group id modulo 500, and an id that is a multiple of 500 aliases the
all-ranks group (../shared/reference/chakra-astrasim.md). All ids of a set have the same
number of decimal digits, so every rank of a class patches the same byte layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

from stg.mesh import DeviceMesh


def ordinal_to_id(ordinal: int) -> int:
    """The ordinal-th positive integer that is not a multiple of 500."""
    return ordinal + 1 + ordinal // 499


def id_to_ordinal(gid: int) -> int:
    return gid - 1 - gid // 500


def first_ordinal(count: int) -> int:
    """Where to start so that `count` ids all have as many digits as the largest needs."""
    digits = 1
    while True:
        lowest = 10 ** (digits - 1)
        first = id_to_ordinal(lowest + (lowest % 500 == 0))  # 1000, 10000, ... are skipped
        if id_to_ordinal(10**digits - 1) - first + 1 >= count:
            return first
        digits += 1


@dataclass(frozen=True)
class GroupIds:
    mesh: DeviceMesh
    kinds: tuple[tuple[str, ...], ...]

    @classmethod
    def for_kinds(cls, mesh: DeviceMesh, kinds: Iterable[tuple[str, ...]]) -> "GroupIds":
        order = mesh.names
        canonical = sorted(set(kinds), key=lambda axes: (len(axes), [order.index(a) for a in axes]))
        return cls(mesh, tuple(canonical))

    @property
    def count(self) -> int:
        return sum(self.mesh.size // math.prod(self.mesh.sizes[a] for a in kind) for kind in self.kinds)

    def _base(self, kind: tuple[str, ...]) -> int:
        base = first_ordinal(self.count)
        for other in self.kinds:
            if other == kind:
                return base
            base += self.mesh.size // math.prod(self.mesh.sizes[a] for a in other)
        raise KeyError(kind)

    def id(self, rank: int, kind: tuple[str, ...]) -> int:
        return ordinal_to_id(self._base(kind) + self.mesh.group_index(rank, kind))

    def table(self) -> Iterator[tuple[int, list[int]]]:
        """(id, members) of every group, in id order: the content of workload.json."""
        for kind in self.kinds:
            base = self._base(kind)
            for index, members in enumerate(self.mesh.groups(kind)):
                yield ordinal_to_id(base + index), members
