"""What the pictures need to know about a written trace set besides its nodes: the mesh,
the communicator groups, the rank classes and their labels (OUT/summary.json and
OUT/workload.json). A set without summary.json (written by hand) is one stage per rank."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from stg.chakra.rank_graph import ALL_RANKS
from stg.errors import ViewError
from stg.mesh import MESH_ORDER, DeviceMesh


@dataclass(frozen=True)
class TraceSet:
    out: Path
    world_size: int
    summary: dict | None  # OUT/summary.json, when there is one
    groups: dict[int, tuple[int, ...]]  # workload.json, by id
    _axes: dict[int | tuple[int, ...], str] = field(default_factory=dict, compare=False, repr=False)  # memo:
    # group id or member tuple -> axes

    @classmethod
    def open(cls, out: str | Path) -> "TraceSet":
        out = Path(out)
        if not (out / "workload.json").is_file():
            raise ViewError(f"out: {out} is not a trace set (no workload.json)")
        try:
            groups = {int(k): tuple(v) for k, v in json.loads((out / "workload.json").read_text()).items()}
            summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        except (ValueError, TypeError, AttributeError) as error:
            raise ViewError(f"out: {out} has an unreadable workload.json or summary.json ({error})") from None
        world = summary["world_size"] if summary else len(list(out.glob("workload.*.et")))
        return cls(out, world, summary, groups)

    @property
    def mesh(self) -> DeviceMesh | None:
        if self.summary is None:
            return None
        return DeviceMesh.standard(**{ax: n for ax, n in self.summary["mesh"].items() if ax in MESH_ORDER})

    def rank_class(self, rank: int) -> int:
        return self.summary["rank_class"][rank] if self.summary else rank

    def representatives(self) -> list[int]:
        """The first rank of every rank class (every rank when the set has no summary)."""
        if self.summary is None:
            return list(range(self.world_size))
        first: dict[int, int] = {}
        for rank, c in enumerate(self.summary["rank_class"]):
            first.setdefault(c, rank)
        return sorted(first.values())

    def one_per_stage(self) -> list[int]:
        """The lowest representative rank of every pipeline stage: the rows of a Gantt chart."""
        first: dict[int, int] = {}
        for rank in self.representatives():
            first.setdefault(self.stage(rank), rank)
        return sorted(first.values())

    def stage(self, rank: int) -> int:
        """The rank's pipeline stage (its own rank number in a set without summary)."""
        mesh = self.mesh
        return mesh.coords(rank)["pp"] if mesh is not None else rank

    def label(self, rank: int) -> str:
        """`rank 4 (class 1: pp=1)`: how the pictures name a rank."""
        if self.summary is None:
            return f"rank {rank}"
        c = self.summary["rank_classes"][self.rank_class(rank)]
        where = " ".join(f"{ax}={v}" for ax, v in c.get("coords", {}).items())
        return f"rank {rank} (class {c['class']}" + (f": {where})" if where else ")")

    def class_label(self, c: int) -> str:
        """A rank class by its coordinates (`pp=1`); classes that share coordinates (embedding
        slots, expert loads) by their first rank and how many ranks are alike (`rank 3 +7`)."""
        cls = self.summary["rank_classes"][c]
        coords = cls.get("coords")
        if coords and "variant" not in cls:
            return " ".join(f"{ax}={v}" for ax, v in coords.items())
        first = cls.get("first_rank", self.summary["rank_class"].index(c))
        return f"rank {first}" + (f" +{cls['count'] - 1}" if cls.get("count", 1) > 1 else "")

    def axes_of(self, members: tuple[int, ...] | list[int]) -> str:
        """The mesh axes a set of ranks spans (`dp+tp`), from their coordinates."""
        key = tuple(members)
        if key not in self._axes:
            mesh = self.mesh
            if mesh is None:
                return "?"
            coords = [mesh.coords(m) for m in key]
            self._axes[key] = "+".join(ax for ax in mesh.names if len({c[ax] for c in coords}) > 1) or "-"
        return self._axes[key]

    @staticmethod
    def group_of(pg_name: str) -> int:
        """The group id of a collective's pg_name ("" and "0": all ranks, as ASTRA-sim reads it)."""
        return ALL_RANKS if pg_name in ("", "0") else int(pg_name)

    def members(self, group: int) -> tuple[int, ...] | range:
        return range(self.world_size) if group == ALL_RANKS else self.groups.get(group, ())

    def group_axes(self, group: int) -> str:
        if group not in self._axes:
            self._axes[group] = self.axes_of(tuple(self.members(group)))
        return self._axes[group]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """`0,4,8:12` -> [0, 4, 8, 9, 10, 11], each in 0..world_size-1."""
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            if ":" in part:
                start, stop = (int(x) for x in part.split(":"))
                ranks.update(range(start, stop))
            else:
                ranks.add(int(part))
    except ValueError:
        raise ViewError(f"ranks: expected ranks and ranges like 0,4,8:12, got {text!r}") from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad or not ranks:
        raise ViewError(f"ranks: {bad or 'none'} not in 0..{world_size - 1}")
    return sorted(ranks)
