"""The parallelism plan: the same names in the CLI, in plan.yaml and in the Python API.

    Plan(dp=8, micro_batch=1, global_batch=1024, seq=8192)

Batch vocabulary (Megatron-LM's): `micro_batch` is what one data-parallel rank runs in one
forward/backward; `global_batch` is the samples of one optimizer step over all ranks; the
number of micro-batches each rank runs (gradient accumulation) is
global_batch / (micro_batch * dp), which must be a whole number.

Parallel degrees (Megatron-Core's): `dp` counts every data-parallel rank of the dense layers,
so the world is tp * cp * pp * dp; expert parallelism is carved out of those ranks (`ep`
divides dp), and the experts' own data-parallel group is dp * cp / ep ranks. Plan files
written before this meaning (when the world was dp * ep * tp * cp * pp) are refused if they
give ep and dp without `plan_version: 2`, with the conversion in the message.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import sympy

from stg.costs import Optimizer
from stg.device import DEFAULT_DEVICE, DEVICES
from stg.errors import PlanError
from stg.limits import MAX_LAYERS, MAX_MICROBATCHES, MAX_WORLD, check_int, check_number
from stg.mesh import MESH_ORDER, DeviceMesh
from stg.yamlio import read_yaml


class AttentionFlops(Enum):
    """How the FLOPs of causal attention's score matrices are counted."""

    CAUSAL = "causal"  # the unmasked half: what FlashAttention runs, what Megatron-LM counts
    FULL = "full"  # the whole square: what PyTorch's FlopCounterMode reports

    @property
    def fraction(self) -> sympy.Rational:
        return sympy.Rational(1, 2) if self is AttentionFlops.CAUSAL else sympy.Integer(1)


class Recompute(Enum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"  # re-run the attention core (scores, softmax, dropout, context)
    FULL = "full"  # keep each layer's input only; re-run the whole layer before its backward


# parallel degrees that later strategies bring; refused until they exist, never ignored
_NOT_YET: dict[str, str] = {}
GRAD_DTYPES = ("bf16", "fp32")
DTYPES = ("bf16", "fp16", "fp32")
# dense weights' optimizers by name (per-row ones are for embedding tables, which choose their own)
OPTIMIZERS = {o.label: o for o in Optimizer if not o.per_row}


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # expert tensor parallelism (Megatron-Core's --expert-tensor-parallel-size): 1, or tp (the
    # experts split on their MLP dimension over the tp ranks); Megatron-Core's default is tp
    etp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline stage, for the interleaved schedule
    schedule: str = "1f1b"  # pipeline schedule: gpipe, 1f1b, interleaved, zb-h1
    # blocks per virtual stage; "auto": balanced by compute (embedding on the first, output
    # layer and loss on the last); default: even
    layers_per_stage: tuple[int, ...] | str | None = None
    zero: int = 0
    sp: bool | None = None  # sequence parallelism; default: on when tp > 1 (as Megatron)
    recompute: Recompute = Recompute.NONE
    flash_attention: bool = True  # attention scores stay on chip (no memory traffic, not saved)
    # weights, activations and their communication (bf16, fp16, fp32); default: the model's
    dtype: str | None = None
    # linear layers' GEMMs in fp8, Transformer Engine's recipe (model_zoo/transformer.py)
    fp8: bool = False
    fp8_param_gather: bool = False  # those layers' weights kept and gathered in fp8 only (Megatron's flag)
    grad_dtype: str | None = None  # weight gradients' accumulation and reduction dtype; default: the weight's
    optimizer: str = "adamw"  # the dense weights' optimizer: adamw or adagrad
    # the vocabulary is padded to a multiple of this times tp (Megatron's
    # --make-vocab-size-divisible-by, whose default is 128; 1 pads only what tp needs)
    make_vocab_divisible_by: int = 1
    capacity_factor: float = 1.0  # expert buffer slots per routed token
    expert_skew: float = 0.0  # Zipf exponent of the experts' token loads (0: balanced routing)
    # overrides of the strategies' logical-axis rules: {logical axis: mesh axes, or None to
    # never split it}, e.g. {"mlp": "tp", "heads": None}
    rules: tuple[tuple[str, tuple[str, ...] | None], ...] | None = None
    micro_batch: int = 1
    global_batch: int | None = None  # default: micro_batch * dp (no gradient accumulation)
    seq: int = 2048
    attention_flops: AttentionFlops = AttentionFlops.CAUSAL
    bucket_mb: float = 25.0  # gradient bucket size, MiB (PyTorch DDP's bucket_cap_mb default)
    # recommendation models (parallelism/embedding.py): every table's sharding (data_parallel,
    # table_wise, column_wise, row_wise, table_row_wise, or auto: the greedy planner), per-table
    # choices that override it ({table: sharding, or {sharding, ranks | host}}), column shards
    # per column-wise table, the planner's per-rank memory limit for tables and their
    # optimizer state (default: the device's memory), and ranks per host (the mesh axis
    # `local`; table_row_wise splits rows over a host's ranks, and dp then counts hosts)
    embedding_sharding: str | None = None
    embeddings: Mapping[str, Any] | None = None
    column_shards: int | None = None
    embedding_memory_gib: float | None = None
    local_world_size: int = 1
    device: str = DEFAULT_DEVICE

    def __post_init__(self):
        for name in ("schedule", "device", "optimizer", "grad_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "grad_dtype" and value is None):
                raise PlanError(f"{name}: must be a name, got {value!r}")
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp", "local_world_size"):
            check_int(name, getattr(self, name), PlanError, maximum=MAX_WORLD)
        for name in ("micro_batch", "seq", "make_vocab_divisible_by"):
            check_int(name, getattr(self, name), PlanError)
        world = self.pp * self.dp * self.cp * self.tp * self.local_world_size  # ep is carved out of dp
        if world > MAX_WORLD:
            raise PlanError(f"world size pp*dp*cp*tp*local_world_size = {world:,} is too large (at most "
                            f"{MAX_WORLD:,} ranks)")
        if self.etp not in (1, self.tp):
            raise PlanError(
                f"etp={self.etp}: must be 1 or tp={self.tp}; stg splits experts over the tp ranks or not at all "
                "(Megatron-Core's other sizes re-fold tp with the data-parallel ranks, not implemented)")
        if self.dp % self.ep:
            raise PlanError(
                f"ep={self.ep}: must divide dp={self.dp}; dp counts every data-parallel rank (Megatron-Core's "
                f"meaning: world = tp*cp*pp*dp) and the expert-parallel ranks are carved out of them, so "
                f"{self.ep}-way expert parallelism over {self.dp} expert replicas is dp={self.dp * self.ep}")
        if self.global_batch is None:
            object.__setattr__(self, "global_batch", self.micro_batch * self.data_ranks)
        check_int("global_batch", self.global_batch, PlanError)
        for name, kind in (("attention_flops", AttentionFlops), ("recompute", Recompute)):
            self._parse_enum(name, kind)
        check_number("bucket_mb", self.bucket_mb, PlanError, maximum=2**40)
        check_number("capacity_factor", self.capacity_factor, PlanError, maximum=2**20)
        check_number("expert_skew", self.expert_skew, PlanError, inclusive=True, maximum=100)
        if self.device not in DEVICES:
            raise PlanError(f"device: unknown device {self.device!r}; known: {', '.join(DEVICES)}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"zero: must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)
        if not isinstance(self.sp, bool) or not isinstance(self.flash_attention, bool):
            raise PlanError(f"sp and flash_attention: must be true or false, got {self.sp!r}, {self.flash_attention!r}")
        if self.sp and self.tp == 1:
            raise PlanError("sp: sequence parallelism splits the sequence over tp, so it needs tp > 1")
        from stg.schedule import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule: unknown schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise PlanError(f"vpp={self.vpp}: virtual stages need schedule interleaved, not {self.schedule!r}")
        if self.vpp == 1 and self.schedule == "interleaved":
            raise PlanError("schedule: interleaved runs virtual stages; it needs vpp > 1")
        if self.vpp > 1 and self.pp == 1:
            raise PlanError(f"vpp={self.vpp}: virtual stages interleave pipeline stages; they need pp > 1")
        if self.layers_per_stage is not None and self.layers_per_stage != "auto":
            split = self.layers_per_stage
            if not isinstance(split, (list, tuple)) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_LAYERS for n in split):
                raise PlanError(f"layers_per_stage: must be a list of block counts or auto, got {split!r}")
            object.__setattr__(self, "layers_per_stage", tuple(split))
            if len(split) != self.pp * self.vpp:
                raise PlanError(f"layers_per_stage: {len(split)} entries, but pp*vpp = {self.pp}*{self.vpp} = {self.pp * self.vpp} stages")
        if self.rules is not None:
            object.__setattr__(self, "rules", _parse_rules(self.rules))
        if self.column_shards is not None:
            check_int("column_shards", self.column_shards, PlanError, maximum=MAX_WORLD)
        if self.embedding_memory_gib is not None:
            check_number("embedding_memory_gib", self.embedding_memory_gib, PlanError, maximum=2**30)
        if self.embedding_sharding is not None and (not isinstance(self.embedding_sharding, str)
                                                    or not self.embedding_sharding):
            raise PlanError(f"embedding_sharding: must be a sharding name or auto, got {self.embedding_sharding!r}")
        if self.embeddings is not None and not isinstance(self.embeddings, Mapping):
            raise PlanError(f"embeddings: must map table names to shardings, got {self.embeddings!r}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer: must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}")
        if not isinstance(self.fp8, bool) or not isinstance(self.fp8_param_gather, bool):
            raise PlanError(f"fp8 and fp8_param_gather: must be true or false, got {self.fp8!r}, {self.fp8_param_gather!r}")
        if self.fp8_param_gather and not (self.fp8 and self.zero >= 1):
            raise PlanError("fp8_param_gather: gathers the fp8 parameters, so it needs fp8 and zero >= 1 (Megatron's "
                            "distributed optimizer; 3 for FSDP)")
        if self.fp8 and DEVICES[self.device].fp8_tflops is None:
            raise PlanError(f"fp8: device {self.device} has no fp8 tensor cores")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise PlanError(f"dtype: must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.grad_dtype is not None and self.grad_dtype not in GRAD_DTYPES:
            raise PlanError(f"grad_dtype: must be one of {list(GRAD_DTYPES)}, got {self.grad_dtype!r}")
        for name, what in _NOT_YET.items():
            if getattr(self, name) != 1:
                raise PlanError(f"{name}={getattr(self, name)}: {what} is not implemented yet (only {name}=1)")
        per_step = self.micro_batch * self.data_ranks
        if self.global_batch % per_step:
            factors = [("micro_batch", self.micro_batch), ("dp", self.dp), ("local_world_size", self.local_world_size)]
            factors = [f for f in factors if f[0] in ("micro_batch", "dp") or f[1] > 1]
            raise PlanError(
                f"global_batch={self.global_batch} is not a multiple of {'*'.join(n for n, _ in factors)}"
                f" = {'*'.join(str(v) for _, v in factors)} = {per_step}"
            )
        if self.microbatches > MAX_MICROBATCHES:
            raise PlanError(f"global_batch={self.global_batch}: {self.microbatches:,} micro-batches per rank is too "
                            f"many (at most {MAX_MICROBATCHES:,}); raise micro_batch or dp")

    def _parse_enum(self, name: str, kind: type[Enum]) -> None:
        value = getattr(self, name)
        if isinstance(value, kind):
            return
        try:
            object.__setattr__(self, name, kind(value))
        except ValueError:
            raise PlanError(f"{name}: must be one of {[m.value for m in kind]}, got {value!r}") from None

    @property
    def microbatches(self) -> int:
        """Micro-batches each rank runs per optimizer step (gradient accumulation steps)."""
        return self.global_batch // (self.micro_batch * self.data_ranks)

    @property
    def data_ranks(self) -> int:
        """Ranks that take different data: dp (expert parallelism is carved out of it, as in
        Megatron-Core) x local_world_size."""
        return self.dp * self.local_world_size

    @property
    def expert_data_parallel(self) -> int:
        """Megatron-Core's expert-data-parallel size: the ranks holding the same experts."""
        return self.dp * self.cp // self.ep

    @property
    def world_size(self) -> int:
        return self.mesh().size

    def mesh(self) -> DeviceMesh:
        # the mesh's dp axis is the part of dp that ep does not take (its expert-data-parallel
        # replicas): rank = tp + T*(cp + C*(ep + E*(dp/ep ...))), Megatron-Core's order
        return DeviceMesh.standard(pp=self.pp, dp=self.dp // self.ep, ep=self.ep, cp=self.cp, tp=self.tp,
                                   local=self.local_world_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "plan") -> "Plan":
        data = dict(data)
        version = data.pop("plan_version", PLAN_VERSION)  # the plan files' mark of dp's meaning
        if version != PLAN_VERSION:
            raise PlanError(f"{where}: plan_version: must be {PLAN_VERSION}, got {version!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> "Plan":
        """A plan file, with `overrides` (e.g. options given on the command line) on top."""
        path = Path(path)
        data = read_yaml(path, f"plan file {path}", PlanError)
        if not isinstance(data, dict):
            raise PlanError(f"plan file {path}: expected a mapping of plan keys")
        data = _current_meaning(data, f"plan file {path}")
        return cls.from_dict({**data, **(overrides or {})}, where=f"plan file {path}")

    def to_dict(self) -> dict[str, Any]:
        data = {field.name: getattr(self, field.name) for field in fields(self)}  # a plan's values are flat
        data["attention_flops"] = self.attention_flops.value
        data["recompute"] = self.recompute.value
        if isinstance(self.layers_per_stage, tuple):
            data["layers_per_stage"] = list(self.layers_per_stage)
        if self.rules is not None:
            data["rules"] = {k: list(v) if v is not None else None for k, v in self.rules}
        if self.embeddings is not None:
            data["embeddings"] = dict(self.embeddings)
        return data


PLAN_VERSION = 2  # 2: dp counts every data-parallel rank, ep is carved out of it


def _current_meaning(data: dict, where: str) -> dict:
    """A plan file that gives dp and ep > 1 without `plan_version` may mean the old dp
    (expert-data-parallel replicas, world dp * ep * ...): refused, with the conversion, rather
    than silently given fewer ranks."""
    ep = data.get("ep", 1)
    if "plan_version" not in data and "dp" in data and isinstance(ep, int) and ep > 1:
        dp = data["dp"]
        raise PlanError(
            f"{where}: gives dp={dp} and ep={ep}, whose meaning changed: dp now counts every data-parallel "
            f"rank (Megatron-Core's; ep is carved out of it). If this file meant {dp}*{ep} data-parallel ranks "
            f"(the old meaning), write dp: {dp * ep}; then add plan_version: {PLAN_VERSION}")
    return data


def _parse_rules(rules) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    wanted = "rules: must map logical axes to a mesh axis, a list of them, or null"
    if isinstance(rules, Mapping):
        items = list(rules.items())
    elif isinstance(rules, (list, tuple)) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rules):
        items = list(rules)
    else:
        raise PlanError(f"{wanted}, got {rules!r}")
    parsed = []
    for logical, axes in items:
        if not isinstance(logical, str):
            raise PlanError(f"{wanted}, got key {logical!r}")
        if axes is not None:
            axes = (axes,) if isinstance(axes, str) else axes
            if not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
                raise PlanError(f"rules: {logical}: must be a mesh axis, a list of them, or null, got {axes!r}")
            axes = tuple(axes)
            unknown = [a for a in axes if a not in MESH_ORDER]
            if unknown:
                raise PlanError(f"rules: {logical}: unknown mesh axes {unknown}; known: {list(MESH_ORDER)}")
        parsed.append((str(logical), axes))
    return tuple(sorted(parsed, key=lambda kv: kv[0]))

