"""Repeated blocks: a pass that walks a graph op by op does the same work for every copy of
a block (126 for Llama 3 405B) up to names. The sharding and autodiff passes each give a
block a *signature* -- its ops and the pass's state of every name it reads, with each name
replaced by its place in the block's name table -- and replay an earlier block of equal
signature under the new names instead of running its ops. What both share lives here."""

from __future__ import annotations

from itertools import groupby
from typing import Iterable, Iterator

from stg.graph import Op, Tensor


def blocks(ops: Iterable[Op]) -> Iterator[list[Op]]:
    """Runs of consecutive ops of one layer."""
    for _, block in groupby(ops, key=lambda op: op.layer):
        yield list(block)


class NameTable:
    """A block's names in order of first use; `at(name)` is a name's place, which is what a
    signature holds instead of the name."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.index: dict[str, int] = {}

    def copy(self) -> "NameTable":
        table = NameTable()
        table.names, table.index = list(self.names), dict(self.index)
        return table

    def at(self, name: str) -> int:
        place = self.index.get(name)
        if place is None:
            place = self.index[name] = len(self.names)
            self.names.append(name)
        return place

    def extend(self, names) -> None:
        """at(name) for each of `names`, in order (each once)."""
        index = self.index
        new = [name for name in dict.fromkeys(names) if name not in index]
        index.update(zip(new, range(len(self.names), len(self.names) + len(new))))
        self.names.extend(new)

    def attrs(self, attrs) -> tuple:
        """An op's attributes, with the names they hold (gradient targets, an optimizer's
        weight) by place; other values as they are (a block whose values differ has another
        signature)."""
        return tuple((k, tuple(map(self.at, v)) if k == "grad_of" else self.at(v) if k == "weight" else v)
                     for k, v in attrs.items())


def signature_of(tensor: Tensor | None) -> tuple | None:
    """A tensor in a signature: everything but its name (None: no such tensor yet)."""
    return None if tensor is None else tensor.signature


def renaming(template: list[str], names: list[str], made: Iterable[str],
             derived: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Template name -> this block's name: the table's by place, each name the template made
    from its base name and suffix (`derived`, in the order they were made)."""
    rename = dict(zip(template, names))
    for name in made:
        if name not in rename:
            base, suffix = derived[name]
            rename[name] = rename[base] + suffix
    return rename


def renamed_attrs(attrs, rename: dict[str, str]) -> dict:
    """A template op's attributes under this block's names (see NameTable.attrs)."""
    return {k: tuple(rename[x] for x in v) if k == "grad_of" else rename[v] if k == "weight" else v
            for k, v in attrs.items()}
