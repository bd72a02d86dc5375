"""Recommendation models: DLRM (Naumov et al. 2019) and DLRM-DCNv2 (Wang et al. 2021).

Dense features go through a bottom MLP; each sparse feature's ids are looked up in its
embedding table and sum-pooled (its pooling factor is the mean number of ids per sample);
the bottom output and the pooled vectors meet in a feature interaction -- DLRM's pairwise
dot products, or DCN-v2's low-rank cross layers -- and a top MLP gives one logit per sample.

Embedding tables are looked up in groups, one kernel and one exchange per group, as TorchRec
does (FBGEMM's table-batched embedding per sharding type): a group's tables are stacked by
rows into one weight [rows, dim]. How tables are grouped and placed is the plan's
(parallelism/embedding.py); the model only says what the tables are. A group whose tables
sit in *slots* (one per rank, or per host) stacks them slot by slot, every slot padded to
the group's widest; the symbols R, L, F of such a group are one slot's rows, ids per sample
and pooled features, bound per rank class.

Logical axes: batch, dense_features, emb (the embedding dimension), features (the vectors
that interact), pairs, cross_rank, <group>.rows / <group>.ids / <group>.features, and one
axis per MLP width (bottom0, top1, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any, Sequence

import sympy

from stg.builder import GraphBuilder
from stg.costs import Optimizer, Pointwise
from stg.errors import ModelSpecError
from stg.graph import DType, Graph
from stg.limits import MAX_TABLES, check_int, check_number
from stg.symbols import B

D = sympy.Symbol("D", positive=True, integer=True)  # embedding dimension


@dataclass(frozen=True)
class Table:
    name: str
    rows: int
    pooling: Fraction = Fraction(1)  # ids per sample (mean); 1 for one-hot features

    def to_dict(self) -> dict:
        return {"name": self.name, "rows": self.rows, "pooling": float(self.pooling)}


@dataclass(frozen=True)
class TableGroup:
    """Tables looked up by one kernel. `slots` > 1: each slot (a rank, or a host) holds
    whole tables or column shards of its own, stacked by rows; `columns` column shards per
    table, each `dim / columns` wide. `fused`: the backward updates the touched rows in
    place (TorchRec's fused kernel); otherwise it makes a dense table gradient (data
    parallel tables, all-reduced)."""

    name: str
    tables: tuple[int, ...]  # indices into the model's tables
    slots: Any = 1  # a product of mesh-axis size symbols, or 1
    columns: int = 1
    fused: bool = True

    @property
    def symbols(self) -> tuple[sympy.Symbol, sympy.Symbol, sympy.Symbol]:
        """(rows, ids per sample, pooled features) of one slot (of the group when slots is 1)."""
        return (sympy.Symbol(f"R_{self.name}", nonnegative=True, integer=True),
                sympy.Symbol(f"L_{self.name}", nonnegative=True),
                sympy.Symbol(f"F_{self.name}", nonnegative=True, integer=True))

    def sizes(self, tables: Sequence[Table], shards: Sequence[int] | None = None,
              row_multiple: int = 1) -> dict[sympy.Symbol, Any]:
        """The symbols' values for the shards `shards` (indices into `tables`, one per column
        shard; all the group's shards when None), each table's rows padded to a multiple of
        `row_multiple` (the ranks it is split over, as TorchRec pads a row-wise table)."""
        shards = [t for t in self.tables for _ in range(self.columns)] if shards is None else shards
        rows, ids, features = self.symbols
        return {rows: sum(-(-tables[t].rows // row_multiple) * row_multiple for t in shards),
                ids: sympy.Rational(sum((tables[t].pooling for t in shards), Fraction(0))),
                features: len(shards)}


@dataclass(frozen=True)
class DLRMConfig:
    name: str
    family: str
    dense_features: int
    embedding_dim: int
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]
    tables: tuple[Table, ...]
    interaction: str = "dot"  # dot (DLRM) or dcn (DCN-v2 low-rank cross layers)
    cross_layers: int = 3
    cross_rank: int = 512
    dtype: str = "fp32"  # dense part
    embedding_dtype: str = "fp32"

    layers = 1  # one block: nothing for a pipeline to split

    @classmethod
    def from_dict(cls, spec: dict) -> "DLRMConfig":
        name = spec.get("name", "<unnamed>")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ModelSpecError(f"model {name}: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [f for f in ("dense_features", "embedding_dim", "bottom_mlp", "top_mlp", "tables") if f not in spec]
        if missing:
            raise ModelSpecError(f"model {name}: missing field(s) {missing}")
        data = dict(spec)
        for key in ("dense_features", "embedding_dim", "cross_layers", "cross_rank"):
            if key in data:
                _positive(name, key, data[key])
        for key in ("bottom_mlp", "top_mlp"):
            widths = data[key]
            if not isinstance(widths, list) or not widths:
                raise ModelSpecError(f"model {name}: {key} must be a non-empty list of layer widths")
            for width in widths:
                _positive(name, key, width)
            data[key] = tuple(widths)
        data["tables"] = _tables(name, data["tables"])
        if data.get("interaction", "dot") not in ("dot", "dcn"):
            raise ModelSpecError(f"model {name}: interaction must be 'dot' or 'dcn', got {data['interaction']!r}")
        for key in ("dtype", "embedding_dtype"):
            try:
                DType.parse(data.get(key, "fp32"))
            except ValueError as error:
                raise ModelSpecError(f"model {name}: {key}: {error}") from None
        config = cls(**data)
        if config.bottom_mlp[-1] != config.embedding_dim:
            raise ModelSpecError(f"model {name}: bottom_mlp ends at {config.bottom_mlp[-1]}, but its output "
                                 f"interacts with the embeddings: it must end at embedding_dim={config.embedding_dim}")
        if config.top_mlp[-1] != 1:
            raise ModelSpecError(f"model {name}: top_mlp must end in one logit, got {config.top_mlp[-1]}")
        return config

    @property
    def features(self) -> int:
        """The vectors that interact: the bottom MLP's output and one pooled vector per table."""
        return 1 + len(self.tables)

    @property
    def top_input(self) -> int:
        d, f = self.embedding_dim, self.features
        return d + f * (f - 1) // 2 if self.interaction == "dot" else f * d

    def default_groups(self) -> tuple[TableGroup, ...]:
        """Every table in one group on one device (what the model is, before any plan)."""
        return (TableGroup("tables", tuple(range(len(self.tables)))),)

    def sizes(self, **_) -> dict[sympy.Symbol, Any]:
        sizes: dict[sympy.Symbol, Any] = {D: self.embedding_dim}
        for group in self.default_groups():
            sizes.update(group.sizes(self.tables))
        return sizes


def _positive(name: str, key: str, value: Any) -> None:
    check_int(f"model {name}: {key}", value, ModelSpecError)


def _tables(name: str, items: Any) -> tuple[Table, ...]:
    """`tables`: a list of row counts, or of {rows, pooling, name} mappings."""
    if not isinstance(items, list) or not items:
        raise ModelSpecError(f"model {name}: tables must be a non-empty list of row counts or {{rows, pooling, name}}")
    if len(items) > MAX_TABLES:
        raise ModelSpecError(f"model {name}: tables: {len(items):,} tables is too many (at most {MAX_TABLES:,})")
    tables = []
    for i, item in enumerate(items):
        item = {"rows": item} if not isinstance(item, dict) else item
        unknown = sorted(set(item) - {"rows", "pooling", "name"})
        if unknown:
            raise ModelSpecError(f"model {name}: tables[{i}]: unknown field(s) {unknown}; known: name, pooling, rows")
        _positive(name, f"tables[{i}].rows", item.get("rows"))
        pooling = check_number(f"model {name}: tables[{i}].pooling", item.get("pooling", 1), ModelSpecError,
                               maximum=2**20)
        tables.append(Table(str(item.get("name", f"t{i}")), item["rows"], Fraction(str(pooling))))
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ModelSpecError(f"model {name}: table names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    return tuple(tables)


def _mlp(g: GraphBuilder, prefix: str, x: str, widths: Sequence[int], dtype: DType, relu_last: bool) -> str:
    """Linear layers with biases and ReLUs; the first takes all of x's non-batch dimensions."""
    for i, width in enumerate(widths):
        src = g.tensors[x]
        letters = "ijkl"[: len(src.shape) - 1]
        axis = f"{prefix}{i}"
        w = g.weight(f"{prefix}.{i}.weight", [*src.shape[1:], width], [*src.dims[1:], axis], dtype)
        b = g.weight(f"{prefix}.{i}.bias", [width], [axis], dtype)
        y = g.pointwise(f"{prefix}.{i}.bias_add", Pointwise.ADD, g.einsum(f"{prefix}.{i}", f"b{letters},{letters}o->bo", x, w), b)
        x = g.pointwise(f"{prefix}.{i}.relu", Pointwise.RELU, y) if relu_last or i < len(widths) - 1 else y
    return x


def build_dlrm(config: DLRMConfig, groups: Sequence[TableGroup] | None = None) -> Graph:
    """Forward graph of one micro-batch with the tables grouped as `groups` (default: one
    group, unsharded)."""
    groups = groups or config.default_groups()
    dtype, edtype = DType.parse(config.dtype), DType.parse(config.embedding_dtype)
    g = GraphBuilder()
    dense = g.input("dense", [B, config.dense_features], ["batch", "dense_features"], dtype)
    bottom = _mlp(g, "bottom", dense, config.bottom_mlp, dtype, relu_last=True)
    pooled = []
    for group in groups:
        rows, ids, features = group.symbols
        table = g.weight(f"emb.{group.name}", [group.slots * rows, D / group.columns],
                         [f"{group.name}.rows", "emb" if group.columns == 1 else "emb_shard"], edtype)
        lookups = g.input(f"ids.{group.name}", [B, group.slots * ids], ["batch", f"{group.name}.ids"])
        lengths = g.input(f"lengths.{group.name}", [B, group.slots * features], ["batch", f"{group.name}.features"],
                          DType.INT32)
        pooled.append(g.embedding_bag(f"pooled.{group.name}", table, lookups, lengths,
                                      update="fused" if group.fused else "dense", fn=Optimizer.ROWWISE_ADAGRAD))
    f = config.features
    g.layer = 1  # the interaction is the model's one block (0: bottom MLP and lookups, 2: top MLP)
    x0 = g.concat("interaction.features", [bottom, *pooled], [B, f, D], ["batch", "features", "emb"], dim=1)
    if config.interaction == "dot":
        scores = g.einsum("interaction.dot", "bfd,bgd->bfg", x0, x0)  # DLRM's bmm, all f x f products
        pairs = g.gather("interaction.pairs", scores, [B, f * (f - 1) // 2], ["batch", "pairs"])  # below the diagonal
        top_in = g.concat("interaction.out", [bottom, pairs], [B, config.top_input], ["batch", "top_in"], dim=1)
    else:
        top_in = x0
        for i in range(config.cross_layers):  # x_{l+1} = x0 * (U (V x_l) + b) + x_l
            p = f"cross.{i}"
            v = g.weight(f"{p}.v", [f, D, config.cross_rank], ["features", "emb", "cross_rank"], dtype)
            u = g.weight(f"{p}.u", [config.cross_rank, f, D], ["cross_rank", "features", "emb"], dtype)
            b = g.weight(f"{p}.bias", [f, D], ["features", "emb"], dtype)
            low = g.einsum(f"{p}.down", "bfd,fdr->br", top_in, v)
            up = g.pointwise(f"{p}.bias_add", Pointwise.ADD, g.einsum(f"{p}.up", "br,rfd->bfd", low, u), b)
            top_in = g.pointwise(f"{p}.residual", Pointwise.ADD, g.pointwise(f"{p}.gate", Pointwise.MUL, x0, up), top_in)
    g.layer = 2
    logits = _mlp(g, "top", top_in, config.top_mlp, dtype, relu_last=False)
    labels = g.input("labels", [B], ["batch"], DType.FP32)
    g.cross_entropy("loss", logits, labels)  # a one-logit binary cross-entropy, costed as one
    return g.build()
