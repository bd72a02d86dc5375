"""One pipeline stage's iteration as a template: lowered once, valued per step by arithmetic.

Every step of a stage has the same nodes and dependencies; only the numbers differ (FLOPs,
bytes, durations, message sizes), and each is a polynomial in the step's symbols (tokens,
cached tokens, pairs, sampled positions). So the stage is lowered once with a recording
evaluator, every number it asked for is compiled into one integer coefficient matrix, and a
step's numbers are one matrix-vector product: no sympy and no Python per node per step.
Durations follow lowering's rounding (whole microseconds, the error carried forward), which
is round(cumulative exact time) differenced.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

import numpy as np
import sympy

from stg.graph import OpKind
from stg.program import NodeType, RankProgram
from stg.serve.step import StepShape


class _Recorder:
    """An evaluator that keeps every expression lowering evaluates, in order."""

    def __init__(self, evaluate):
        self.evaluate, self.exprs = evaluate, []

    def __call__(self, expr):
        self.exprs.append(expr)
        return self.evaluate(expr)


@dataclass(frozen=True)
class StageTemplate:
    program: RankProgram  # the nodes as lowered at a reference step
    compute: np.ndarray  # indices of compute nodes
    comm: np.ndarray  # indices of collective, send and recv nodes
    monomials: tuple[tuple[int, ...], ...]  # powers of (S, Tkv, Pqk, Nout) per column
    flops: np.ndarray  # [compute nodes, monomials] integer coefficients x denominator
    nbytes: np.ndarray
    comm_bytes: np.ndarray  # [comm nodes, monomials]
    denominator: int
    matmul: np.ndarray  # per compute node: a GEMM (its size's fraction of peak, stg/device.py)
    # sequence parallelism splits a step's tokens over tp: they run padded to a multiple of it
    # (the padding positions go through every linear layer, as vLLM pads them)
    pad: int = 1

    def _eval(self, matrix: np.ndarray, powers: np.ndarray) -> np.ndarray:
        return -(-(matrix @ powers) // self.denominator)  # ceiling

    def powers(self, shape: StepShape) -> np.ndarray:
        values = (-(-shape.tokens // self.pad) * self.pad, shape.kv_tokens, shape.pairs, shape.sampled)
        return np.array([int(np.prod([v ** p for v, p in zip(values, m)])) for m in self.monomials], dtype=np.int64)

    def values(self, shape: StepShape, device) -> dict[str, np.ndarray]:
        """Per node of this step: FLOPs and bytes (compute), durations (us, whole), comm bytes."""
        powers = self.powers(shape)
        flops, nbytes = self._eval(self.flops, powers), self._eval(self.nbytes, powers)
        exact = device.duration_us(flops, nbytes, matmul=self.matmul)
        total = np.round(np.cumsum(exact))
        durations = np.diff(total, prepend=0.0).astype(np.int64)
        return {"flops": flops, "nbytes": nbytes, "exact_us": exact, "duration_us": durations,
                "comm_bytes": self._eval(self.comm_bytes, powers)}


def _terms(expr, static, symbols) -> dict[tuple[int, ...], sympy.Rational]:
    bound = sympy.sympify(expr).xreplace(static)
    try:
        poly = sympy.Poly(bound, *symbols)
    except sympy.PolynomialError:
        poly = None
    if poly is None or not all(c.is_Rational for c in poly.coeffs()):
        raise AssertionError(f"not a polynomial in the step symbols: {bound}")
    return dict(poly.terms())


def build_template(program_of, static: dict, reference: StepShape, symbols: tuple, pad: int = 1) -> StageTemplate:
    """`program_of(evaluate)` lowers the stage with the given evaluator; `static` binds every
    symbol but the step's four (`symbols`: S, Tkv, Pqk, Nout; B = 1 and rho = 1 included)."""
    from stg.serve.engine import StepEvaluator

    recorder = _Recorder(StepEvaluator({}, static, reference))
    program = program_of(recorder)
    exprs, cursor, per_node = recorder.exprs, 0, []
    for node in program.nodes:  # lowering evaluates FLOPs then bytes of a compute node, a size per message
        take = 2 if node.type is NodeType.COMP_NODE else 1
        per_node.append(exprs[cursor:cursor + take])
        cursor += take
    assert cursor == len(exprs), "lowering evaluated expressions this template does not place"
    cache: dict = {}

    def terms(expr):
        if expr not in cache:
            cache[expr] = _terms(expr, static, symbols)
        return cache[expr]

    compute = [i for i, n in enumerate(program.nodes) if n.type is NodeType.COMP_NODE]
    comm = [i for i, n in enumerate(program.nodes) if n.type is not NodeType.COMP_NODE]
    rows = {"flops": [terms(per_node[i][0]) for i in compute], "nbytes": [terms(per_node[i][1]) for i in compute],
            "comm": [terms(per_node[i][0]) for i in comm]}
    monomials = sorted({m for table in rows.values() for row in table for m in row})
    denominator = lcm(1, *(int(c.q) for table in rows.values() for row in table for c in row.values()))
    column = {m: j for j, m in enumerate(monomials)}

    def matrix(table):
        out = np.zeros((len(table), len(monomials)), dtype=np.int64)
        for i, row in enumerate(table):
            for m, c in row.items():
                out[i, column[m]] = int(c * denominator)
        return out

    # a node's op type is its op's label, `kind[detail]`
    gemms = np.array([program.nodes[i].op_type.split("[")[0] == OpKind.EINSUM.value for i in compute], dtype=bool)
    return StageTemplate(program, np.array(compute, dtype=np.int64), np.array(comm, dtype=np.int64),
                         tuple(monomials), matrix(rows["flops"]), matrix(rows["nbytes"]), matrix(rows["comm"]),
                         denominator, gemms, pad)
