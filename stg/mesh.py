"""Device mesh, placements and layouts: the vocabulary of every parallelism strategy.

A DeviceMesh is named axes with sizes and one fixed rank <-> coordinate rule: the last axis
varies fastest. stg's standard order is pp, dp, ep, cp, tp (tp fastest, as in Megatron), so
rank = tp + T*(cp + C*(ep + E*(dp + D*pp))). The plan's data-parallel size is the mesh's
dp x ep: the dp axis counts the experts' data-parallel replicas (parallelism/expert.py).
Recommendation models add `local`, the ranks of a host, after them (hosts are then dp). Groups along some axes are derived, never stored.

A Layout says, per mesh axis, how a tensor sits on it: Shard(d) splits dimension d, Partial
holds a partial sum, and any axis not named replicates it (PyTorch DTensor's vocabulary).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import sympy

from stg.errors import LayoutError

MESH_ORDER = ("pp", "dp", "ep", "cp", "tp", "local")


FLAT = -1  # Shard(FLAT): the flattened tensor split evenly, padded (ZeRO / FSDP flat buffers)


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return "S(flat)" if self.dim == FLAT else f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


Placement = Shard | Replicate | Partial


def axis_symbol(axis: str) -> sympy.Symbol:
    """The symbol of a mesh axis' size, so sharded shapes read `B/dp`."""
    return sympy.Symbol(axis, positive=True, integer=True)


@dataclass(frozen=True)
class Layout:
    """Placements on the mesh axes that do not replicate, in mesh order."""

    placements: tuple[tuple[str, Placement], ...] = ()

    @classmethod
    def of(cls, mapping: Mapping[str, Placement], order: Sequence[str]) -> "Layout":
        return cls(tuple((ax, mapping[ax]) for ax in order if ax in mapping and type(mapping[ax]) is not Replicate))

    def get(self, axis: str) -> Placement:
        return dict(self.placements).get(axis, Replicate())

    def as_dict(self) -> dict[str, Placement]:
        return dict(self.placements)

    def axes_sharding(self, dim: int) -> tuple[str, ...]:
        return self._by_dim.get(dim, ())

    @functools.cached_property
    def _by_dim(self) -> dict[int, tuple[str, ...]]:
        """The mesh axes splitting each dimension (FLAT: the flattened tensor), asked of every
        tensor of every block copy: computed once per layout."""
        by_dim: dict[int, tuple[str, ...]] = {}
        for ax, p in self.placements:
            if type(p) is Shard:
                by_dim[p.dim] = by_dim.get(p.dim, ()) + (ax,)
        return by_dim

    def __hash__(self) -> int:
        # layouts key the sharder's memo; the dataclass hash rehashes every placement each time
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash(self.placements)
        return cached

    def __getstate__(self) -> dict:
        # the caches stay behind: a string's hash differs between processes
        return {"placements": self.placements}

    @property
    def partial_axes(self) -> tuple[str, ...]:
        return tuple(ax for ax, p in self.placements if isinstance(p, Partial))

    @property
    def flat_axes(self) -> tuple[str, ...]:
        return self.axes_sharding(FLAT)

    def local_shape(self, shape: Sequence[sympy.Expr]) -> tuple[sympy.Expr, ...]:
        """One rank's shape. A flat shard holds numel/n elements; it is charged to dimension 0
        (padding makes any size divide, so it is never a divisibility error)."""
        return _local_shape(self, tuple(shape))

    def describe(self, shape: Sequence[sympy.Expr]) -> str:
        """DESIGN.md's notation: `B@dp S@tp P(tp)`; `R` when fully replicated."""
        parts = [f"{shape[i]}@{'*'.join(self.axes_sharding(i))}" for i in range(len(shape)) if self.axes_sharding(i)]
        if self.flat_axes:
            parts.append(f"flat@{'*'.join(self.flat_axes)}")
        if self.partial_axes:
            parts.append(f"P({','.join(self.partial_axes)})")
        return " ".join(parts) or "R"

    def __str__(self) -> str:
        return " ".join(f"{p}@{ax}" for ax, p in self.placements) or "R"


REPLICATED = Layout()


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(layout: Layout, shape: tuple[sympy.Expr, ...]) -> tuple[sympy.Expr, ...]:
    # memoised: every copy of a repeated block asks for the same few (layout, shape) pairs
    flat = sympy.Mul(*(axis_symbol(ax) for ax in layout.flat_axes))
    return tuple(
        dim / sympy.Mul(*(axis_symbol(ax) for ax in layout.axes_sharding(i))) / (flat if i == 0 else 1)
        for i, dim in enumerate(shape)
    )


@dataclass(frozen=True)
class DeviceMesh:
    """Named axes (slowest first) and their sizes."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name}: size must be a positive integer, got {size!r}")

    @classmethod
    def standard(cls, **sizes: int) -> "DeviceMesh":
        """A mesh in stg's standard order; axes not given have size 1."""
        unknown = set(sizes) - set(MESH_ORDER)
        if unknown:
            raise LayoutError(f"unknown mesh axes {sorted(unknown)}; known: {list(MESH_ORDER)}")
        return cls(tuple((ax, sizes.get(ax, 1)) for ax in MESH_ORDER))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.sizes.values())

    def stride(self, axis: str) -> int:
        return self._strides[axis]

    @functools.cached_property
    def _strides(self) -> dict[str, int]:
        """Each axis's stride, asked for every hole of every rank a replay or a written set
        places (a dataclass's cached_property: its __dict__ is its own)."""
        return {name: math.prod(size for _, size in self.axes[k + 1:]) for k, (name, _) in enumerate(self.axes)}

    def coords(self, rank: int) -> dict[str, int]:
        strides = self._strides
        return {name: (rank // strides[name]) % size for name, size in self.axes}

    def rank(self, coords: Mapping[str, int]) -> int:
        return sum(coords.get(name, 0) * self.stride(name) for name in self.names)

    def group(self, rank: int, axes: Sequence[str]) -> list[int]:
        """Ranks that share `rank`'s coordinates off `axes`, ordered by their coordinates on `axes`."""
        members = [self._lowest(rank, axes)]
        sizes = self.sizes
        for ax in sorted(axes, key=self.names.index):
            stride = self.stride(ax)
            members = [m + k * stride for m in members for k in range(sizes[ax])]
        return sorted(members)

    def group_span(self, rank: int, axes: Sequence[str], first: Sequence[int] | None = None) -> tuple[int, int, int]:
        """What `group` holds, counted without listing it: its size, lowest and highest rank;
        `first`: only the members with these coordinates on axes[0] (GroupIds' kept members)."""
        sizes, strides = self.sizes, self._strides
        count = 1
        lowest = highest = self._lowest(rank, axes)
        for k, ax in enumerate(axes):
            values = range(sizes[ax]) if first is None or k else sorted(v for v in first if v < sizes[ax])
            if not values:
                return 0, 0, 0
            count *= len(values)
            lowest += values[0] * strides[ax]
            highest += values[-1] * strides[ax]
        return count, lowest, highest

    def _lowest(self, rank: int, axes: Sequence[str]) -> int:
        """`rank` with its coordinates on `axes` 0: the lowest rank of its group of `axes`."""
        sizes, strides = self.sizes, self._strides
        return rank - sum((rank // strides[ax]) % sizes[ax] * strides[ax] for ax in axes)

    def group_index(self, rank: int, axes: Sequence[str]) -> int:
        """Which group of kind `axes` holds `rank`: the mixed-radix number of its other coordinates."""
        index, strides = 0, self._strides  # (the coordinates without a dict: every slice rank asks)
        for name, size in self.axes:
            if name not in axes:
                index = index * size + (rank // strides[name]) % size
        return index

    def groups(self, axes: Sequence[str]) -> Iterator[list[int]]:
        """Every group of kind `axes`, in group_index order."""
        others = [(name, size) for name, size in self.axes if name not in axes]
        for flat in range(math.prod(size for _, size in others)):
            coords, rest = {}, flat
            for name, size in reversed(others):
                coords[name] = rest % size
                rest //= size
            yield self.group(self.rank(coords), axes)

    def __str__(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes)
