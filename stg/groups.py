"""Communicator group ids: pure arithmetic on the mesh, never a scan over ranks.

Groups of one kind (the mesh axes they span) get consecutive ordinals; kinds follow one
another in a fixed order. Ordinal n becomes id n + 1 + n // 499, which skips every multiple
of 500: ASTRA-sim pairs collectives by group id modulo 500, and an id that is a multiple of
500 aliases the all-ranks group (../shared/reference/chakra-astrasim.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

from stg.mesh import DeviceMesh


def ordinal_to_id(ordinal: int) -> int:
    return ordinal + 1 + ordinal // 499


@dataclass(frozen=True)
class GroupIds:
    mesh: DeviceMesh
    kinds: tuple[tuple[str, ...], ...]

    @classmethod
    def for_kinds(cls, mesh: DeviceMesh, kinds: Iterable[tuple[str, ...]]) -> "GroupIds":
        order = mesh.names
        canonical = sorted(set(kinds), key=lambda axes: (len(axes), [order.index(a) for a in axes]))
        return cls(mesh, tuple(canonical))

    def _base(self, kind: tuple[str, ...]) -> int:
        base = 0
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
