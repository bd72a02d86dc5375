"""Models described op by op (family `graph`): any architecture, no stg code.

A description names its symbolic dimensions with their logical axes and sizes, its
parameters with shapes over those dimensions, and its ops, one a line, in the same notation
`print(graph)` uses:

    name: my-decoder
    family: graph
    dims:                      # symbol: [logical axis, size]; B (batch) and S (seq) come from the plan
      H: [embed, 4096]
      V: [vocab, 32000]
    inputs: {tokens: [B, S], labels: [B, S]}
    blocks:                    # in order; block 0, 1, ... is what pipeline stages split on
      - name: embed
        params: {table: [V, H]}
        ops:
          - x = embedding(table, tokens)
          - x = constrain(x, residual)
      - name: layers           # `repeat` copies get names layers.0, layers.1, ...
        repeat: 32
        params: {norm: [H], w: [H, H]}
        ops:
          - h = rmsnorm(x, norm)
          - y = einsum(bsh,hk->bsk, h, w)
          - x = add(x, y)
      ...

A name assigned again (x = add(x, y)) rebinds it: blocks chain through the names they share.
Ops: einsum(spec, a, b[, causal][, fused]), rmsnorm(x, w), layernorm(x, w, b), add(a, b),
gelu(x), silu(x), swiglu(gate, up), rope(x), softmax(x), dropout(x), embedding(table, ids),
cross_entropy(logits, labels), constrain(x, tag), route(logits, k), dispatch(x, gates,
capacity), combine(buffers, gates). `causal` counts an attention einsum at the plan's causal
fraction; `fused` keeps its output on chip (FlashAttention). Capacity and k are symbols
(E, K, CF ... from dims, or numbers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy

from model_zoo.moe import CF, LOAD
from stg.builder import GraphBuilder
from stg.costs import NormKind, Pointwise
from stg.errors import ModelSpecError, StgError
from stg.expr import ExprError, check_name, parse_size
from stg.graph import Graph
from stg.limits import MAX_LAYERS, check_int
from stg.mesh import MESH_ORDER
from stg.symbols import ATTN_FRACTION, B, S

_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*=\s*([a-z_]+)\((.*)\)\s*$")
_POINTWISE = {"gelu": Pointwise.GELU, "silu": Pointwise.SILU, "swiglu": Pointwise.SWIGLU, "rope": Pointwise.ROPE,
              "add": Pointwise.ADD}
# operands of each op (flags such as `causal` apart); an einsum's spec counts as one
_ARITY = {"einsum": 3, "gelu": 1, "silu": 1, "swiglu": 2, "rope": 1, "add": 2, "rmsnorm": 2, "layernorm": 3,
          "softmax": 1, "dropout": 1, "embedding": 2, "cross_entropy": 2, "constrain": 2, "route": 2,
          "dispatch": 3, "combine": 2}
# dimension names a description cannot declare: stg binds them from the plan or the mesh
_RESERVED = frozenset({"B", "S", "CF", str(LOAD), str(ATTN_FRACTION), *MESH_ORDER})
CONSTRAIN_TAGS = ("residual",)  # the layouts a description may anchor a tensor to


@dataclass(frozen=True)
class DescribedConfig:
    """A parsed description: what `Model` needs (name, family, layers, sizes) and the spec."""

    name: str
    family: str
    layers: int  # repeated blocks (the first block is the prologue, the last the epilogue)
    spec: Any  # the description dict (kept as given; frozen by convention)
    symbols: tuple[tuple[str, int], ...]
    axes: tuple[tuple[str, str], ...]

    def __hash__(self) -> int:
        return hash((self.name, self.symbols))

    @classmethod
    def from_dict(cls, spec: dict) -> "DescribedConfig":
        name = spec.get("name")
        where = f"model {name!r}"
        unknown = sorted(set(spec) - {"name", "family", "dims", "inputs", "blocks"})
        if unknown:
            raise ModelSpecError(f"{where}: unknown field(s) {unknown}; known: blocks, dims, family, inputs, name")
        dims = spec.get("dims") or {}
        if not isinstance(dims, dict):
            raise ModelSpecError(f"{where}: dims must map a symbol to [logical axis, size]")
        symbols, axes = [], [("B", "batch"), ("S", "seq")]
        for symbol, entry in dims.items():
            try:
                check_name(symbol, _RESERVED)
            except ExprError as error:
                raise ModelSpecError(f"{where}: dims: dimension {error}") from None
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise ModelSpecError(f"{where}: dimension {symbol}: expected [logical axis, size], got {entry!r}")
            axis, size = entry
            check_int(f"{where}: dimension {symbol}: size", size, ModelSpecError)
            symbols.append((symbol, size))
            axes.append((symbol, axis))
        if not isinstance(spec.get("inputs") or {}, dict):
            raise ModelSpecError(f"{where}: inputs must map names to shapes")
        blocks = spec.get("blocks")
        if not isinstance(blocks, list) or len(blocks) < 2:
            raise ModelSpecError(f"{where}: blocks must be a list of at least two blocks (the first holds the "
                                 "embedding, the last the head and loss)")
        for index, block in enumerate(blocks):
            if not isinstance(block, dict):
                raise ModelSpecError(f"{where}: block {index} must be a mapping (name, repeat, params, ops)")
            if not isinstance(block.get("params") or {}, dict) or not isinstance(block.get("ops") or [], list) \
                    or not isinstance(block.get("name", ""), str):
                raise ModelSpecError(f"{where}: block {index}: name must be text, params map names to shapes, "
                                     "ops be a list")
            check_int(f"{where}: block {block.get('name', index)}: repeat", block.get("repeat", 1), ModelSpecError,
                      maximum=MAX_LAYERS)
        repeated = sum(b.get("repeat", 1) for b in blocks[1:-1])
        check_int(f"{where}: repeated blocks", max(repeated, 1), ModelSpecError, maximum=MAX_LAYERS)
        return cls(name, spec.get("family", "graph"), repeated, spec, tuple(symbols), tuple(axes))

    def sizes(self, vocab_multiple: int = 1) -> dict[sympy.Symbol, int]:
        axes = dict(self.axes)
        pad = lambda name, size: -(-size // vocab_multiple) * vocab_multiple if axes[name] == "vocab" else size
        return {_symbol(name): pad(name, size) for name, size in self.symbols}


def _symbol(name: str) -> sympy.Symbol:
    return {"B": B, "S": S, "CF": CF}.get(name) or sympy.Symbol(name, positive=True, integer=True)


class _Builder:
    def __init__(self, config: DescribedConfig, flash_attention: bool):
        self.config = config
        self.flash = flash_attention
        self.axis = dict(config.axes)
        self.g = GraphBuilder()
        self.scope: dict[str, str] = {}  # the names a description uses -> graph tensor names
        self.core: set[str] = set()  # outputs of attention-core ops (causal or fused einsums onward)

    def error(self, where: str, message: str) -> ModelSpecError:
        return ModelSpecError(f"model {self.config.name!r}, {where}: {message}")

    def shape(self, where: str, dims: list) -> tuple[list, list[str]]:
        if not isinstance(dims, list) or not dims:
            raise self.error(where, f"shape must be a non-empty list of dimensions, got {dims!r}")
        shape, axes = [], []
        for dim in dims:
            try:
                expr = parse_size(dim, {d: _symbol(d) for d in self.axis})
            except ExprError as error:
                raise self.error(where, f"shape entry {dim!r}: {error}") from None
            free = [str(s) for s in expr.free_symbols]
            if len(free) != 1:
                raise self.error(where, f"dimension {dim!r} must name exactly one declared dimension")
            shape.append(expr)
            axes.append(self.axis[free[0]])
        return shape, axes

    def build(self) -> Graph:
        for name, dims in (self.config.spec.get("inputs") or {}).items():
            shape, axes = self.shape(f"input {name}", dims)
            self.scope[name] = self.g.input(name, shape, axes)
        blocks = self.config.spec["blocks"]
        layer = 0
        for index, block in enumerate(blocks):
            repeat = block.get("repeat", 1)
            template = None  # the first copy, which the others copy where they can
            for copy in range(repeat):
                prefix = block.get("name", f"block{index}") + (f".{copy}" if repeat > 1 else "")
                self.g.layer = layer
                if template is None or not self.copy(template, prefix):
                    entry, core, mark = dict(self.scope), set(self.core), self.g.mark()
                    self.block(block, prefix)
                    if repeat > 1 and template is None:
                        template = self.template(prefix, entry, core, mark)
                layer += 1
        head_ops = [str(line).split("=", 1)[-1].strip() for line in blocks[-1].get("ops") or []]
        if not any(op.startswith("cross_entropy(") for op in head_ops):
            raise self.error(f"block {blocks[-1].get('name', len(blocks) - 1)}", "no loss: the last block must end "
                             "in `loss = cross_entropy(logits, labels)`, where the backward starts")
        return self.g.build()

    def template(self, prefix: str, entry: dict[str, str], core: set[str], mark: tuple[int, int]) -> tuple | None:
        """The block copy just built (since `mark`, with `entry` the scope and `core` the
        attention-core outputs before it) as a later copy repeats it: the graph's block, the
        scope names it reads (each tensor it reads from before it, with whether that was an
        attention-core output), the scope entries and core outputs it made. None where it
        made something outside its prefix."""
        block = self.g.block(mark, prefix)
        changed = {k: v for k, v in self.scope.items() if entry.get(k) != v}
        added = self.core - core
        if block is None or not set(changed.values()) | added <= block.made:
            return None
        keys = {name: (tuple(k for k, v in entry.items() if v == name), name in core) for name in block.reads}
        return block, keys, changed, added

    def copy(self, template: tuple, prefix: str) -> bool:
        """The block under `prefix` as a renamed copy of `template` (no parsing, no sympy);
        False where it would not read alike (a scope name bound otherwise, an input that is an
        attention-core output in one and not the other) or a name is taken: then it is built."""
        block, keys, changed, added = template
        rename = block.renaming(prefix)
        if any(self.g.named(name) for name in rename.values()):
            return False
        for name, (scope_keys, core) in keys.items():
            now = {self.scope.get(k) for k in scope_keys}
            if len(now) != 1 or None in now or (next(iter(now)) in self.core) != core:
                return False
            rename[name] = now.pop()
        self.g.add_copy(block, rename, self.g.layer)
        self.scope.update((k, rename[v]) for k, v in changed.items())
        self.core.update(rename[name] for name in added)
        return True

    def block(self, block: dict, prefix: str) -> None:
        local = dict(self.scope)
        for name, dims in (block.get("params") or {}).items():
            shape, axes = self.shape(f"parameter {prefix}.{name}", dims)
            local[name] = self.g.weight(f"{prefix}.{name}", shape, axes)
        for line in block.get("ops") or []:
            match = _LINE.match(str(line))
            if not match:
                raise self.error(f"block {prefix}", f"cannot read op {line!r}; expected `out = op(args)`")
            out, op, args = match.groups()
            if op not in _ARITY:
                raise self.error(f"op {prefix}.{out} = {op}(...)", f"unknown op {op!r}; known: {', '.join(_ARITY)}")
            try:
                local[out] = self.op(f"{prefix}.{out}", op, _split(args), local)
            except StgError as err:
                raise self.error(f"op {prefix}.{out} = {op}(...)", str(err)) from None
        self.scope.update({k: v for k, v in local.items() if k in self.scope or k not in (block.get("params") or {})})

    def op(self, name: str, op: str, args: list[str], local: dict[str, str]) -> str:
        g = self.g
        name = _unique(name, g.tensors)
        flags = {a for a in args if a in ("causal", "fused")}
        values = [a for a in args if a not in flags]
        if len(values) != _ARITY[op]:
            raise ModelSpecError(f"{op} takes {_ARITY[op]} argument(s), got {len(values)}")
        if flags and op != "einsum":
            raise ModelSpecError(f"{sorted(flags)[0]} applies to einsum only")

        def tensor(arg: str) -> str:
            if arg not in local:
                raise ModelSpecError(f"unknown tensor {arg!r} (not an input, a parameter or an earlier op's output)")
            return local[arg]

        if op == "einsum":
            spec, a, b = values
            core = bool(flags) or local.get(a) in self.core
            out = g.einsum(name, spec.strip("'\""), tensor(a), tensor(b), density=ATTN_FRACTION if "causal" in flags else 1,
                           transient="fused" in flags and self.flash, **({"attention_core": True} if core else {}))
            if core:
                self.core.add(out)
            return out
        if op in _POINTWISE:
            return g.pointwise(name, _POINTWISE[op], *map(tensor, values))
        if op in ("rmsnorm", "layernorm"):
            kind = NormKind.RMS_NORM if op == "rmsnorm" else NormKind.LAYER_NORM
            return g.norm(name, kind, *map(tensor, values))
        if op in ("softmax", "dropout"):
            core = tensor(values[0]) in self.core  # part of an attention core: selective recompute re-runs it
            out = (g.softmax if op == "softmax" else g.dropout)(name, tensor(values[0]),
                                                                **({"attention_core": True} if core else {}))
            if core:
                self.core.add(out)
            return out
        if op == "embedding":
            return g.embedding(name, tensor(values[0]), tensor(values[1]))
        if op == "cross_entropy":
            return g.cross_entropy(name, tensor(values[0]), tensor(values[1]))
        if op == "constrain":
            if values[1] not in CONSTRAIN_TAGS:
                raise ModelSpecError(f"constrain: unknown layout {values[1]!r}; known: {', '.join(CONSTRAIN_TAGS)}")
            return g.constrain(name, tensor(values[0]), values[1])
        if op == "route":
            return g.route(name, tensor(values[0]), self.size("k", values[1]))
        if op == "dispatch":
            return g.dispatch(name, tensor(values[0]), tensor(values[1]), self.size("capacity", values[2]))
        assert op == "combine", op
        return g.combine(name, tensor(values[0]), tensor(values[1]))

    def size(self, what: str, text: str) -> sympy.Expr:
        """A size argument (route's k, dispatch's capacity): declared dimensions, CF, integers."""
        try:
            return parse_size(text, {d: _symbol(d) for d in self.axis} | {"CF": CF})
        except ExprError as error:
            raise ModelSpecError(f"{what} {text!r}: {error}") from None


def _split(args: str) -> list[str]:
    return [part.strip() for part in args.split(",") if part.strip()] if "->" not in args else _split_einsum(args)


def _split_einsum(args: str) -> list[str]:
    """`bsh,hf->bsf, a, b`: the spec's own commas stay inside it."""
    spec_end = args.index("->")
    rest = args[spec_end:].split(",")
    spec = args[:spec_end] + rest[0]
    return [spec.strip(), *(part.strip() for part in rest[1:] if part.strip())]


def _unique(name: str, taken) -> str:
    """A name rebound in a block (x = add(x, y)) gets a fresh graph name: x, x#1, ..."""
    if name not in taken:
        return name
    n = 1
    while f"{name}#{n}" in taken:
        n += 1
    return f"{name}#{n}"


def build_described(config: DescribedConfig, flash_attention: bool = True) -> Graph:
    return _Builder(config, flash_attention).build()
