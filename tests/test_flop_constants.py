"""Every per-element FLOP constant of stg/costs.py, re-derived here by running its defining
formula (cited per case) on a number that counts its operations: each +, -, *, /, power and
elementary function (exp, tanh, sqrt, max) is one FLOP. Reductions over a row (a sum, a mean,
a max) cost one operation per element; scalars computed once per tensor or per row
(1 - lr*wd, bias corrections' denominators) are not per-element work."""

from __future__ import annotations

import pytest

from stg.costs import (CROSS_ENTROPY_FLOPS, LOSS_FLOPS, SOFTMAX_FLOPS, SOFTMAX_GRAD_FLOPS, NormKind, Optimizer,
                       Pointwise)


class Counted:
    ops = 0

    def _op(self, *_):
        Counted.ops += 1
        return Counted()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __pow__ = _op
    __neg__ = _op


def fn(*_):  # exp, tanh, sqrt, max ...: one operation
    Counted.ops += 1
    return Counted()


def reduce(_):  # one add (or max) per element of the row it runs over
    Counted.ops += 1
    return Counted()


def count(formula) -> int:
    Counted.ops = 0
    formula(*(Counted() for _ in range(formula.__code__.co_argcount)))
    return Counted.ops


# Per element, forward. Sources: GELU's tanh form (Hendrycks & Gimpel 2016, eq. in section 2;
# PyTorch approximate="tanh"), SiLU (Elfwing et al. 2018), SwiGLU (Shazeer 2020), RMSNorm
# (Zhang & Sennrich 2019), LayerNorm (Ba et al. 2016), softmax with max subtraction (as every
# fused kernel computes it).
FORWARD = {
    "gelu": (Pointwise.GELU.forward_flops, lambda x: 0.5 * x * (1 + fn(0.79788456 * (x + 0.044715 * x ** 3)))),
    "silu": (Pointwise.SILU.forward_flops, lambda x: x / (1 + fn(-x))),
    "swiglu": (Pointwise.SWIGLU.forward_flops, lambda gate, up: gate / (1 + fn(-gate)) * up),
    "relu": (Pointwise.RELU.forward_flops, lambda x: fn(x)),
    "add": (Pointwise.ADD.forward_flops, lambda a, b: a + b),
    "mul": (Pointwise.MUL.forward_flops, lambda a, b: a * b),
    # x * rsqrt(mean(x^2) + eps) * g: square, sum into the mean, the row's rsqrt applied, scale
    "rmsnorm": (NormKind.RMS_NORM.forward_flops, lambda x, r, g: (reduce(x * x), x * r * g)),
    # mean (sum), subtract, square, variance (sum), normalise by the row's rsqrt, scale, shift
    "layernorm": (NormKind.LAYER_NORM.forward_flops,
                  lambda x, r, g, b: (reduce(x), d := x - r, reduce(d * d), d * r * g + b)),
    # max, subtract, exp, sum, divide
    "softmax": (SOFTMAX_FLOPS, lambda x, mx, s: (reduce(x), e := fn(x - mx), reduce(e), e / s)),
    # per logit: the softmax's five, then log-sum-exp and the label's pick are per token
    "cross_entropy": (CROSS_ENTROPY_FLOPS, lambda x, mx, s: (reduce(x), e := fn(x - mx), reduce(e), e / s)),
}


@pytest.mark.parametrize("name", FORWARD)
def test_forward_constants(name):
    constant, formula = FORWARD[name]
    assert count(formula) == constant


def test_softmax_backward_and_loss():
    # dx = y * (dy - sum(dy * y)): multiply, sum, subtract, multiply
    assert count(lambda y, dy, s: (reduce(dy * y), y * (dy - s))) == SOFTMAX_GRAD_FLOPS
    # per token: log of the sum, plus the max back, minus the label's logit
    assert count(lambda s, mx, t: fn(s) + mx - t) == LOSS_FLOPS


def test_optimizer_constants():
    # AdamW (Loshchilov & Hutter 2019; torch.optim.AdamW's algorithm): decay by the scalar
    # (1 - lr*wd), both moments, bias corrections, sqrt, +eps, divide, step
    adamw = count(lambda p, g, m, v, c1, c2, lr, b1, b2, eps: (
        p * c1, m2 := b1 * m + (1 - b1) * g, v2 := b2 * v + (1 - b2) * g * g,
        p - lr * ((m2 / c1) / (fn(v2 / c2) + eps))))
    # (1 - b1), (1 - b2), (1 - lr*wd) are scalars: drop their two subtractions
    assert adamw - 2 == Optimizer.ADAMW.flops
    # Adagrad (Duchi et al. 2011; torch.optim.Adagrad: addcmul_, sqrt().add_(eps), addcdiv_)
    adagrad = count(lambda p, g, s, lr, eps: (s2 := s + g * g, p - lr * g / (fn(s2) + eps)))
    assert adagrad == Optimizer.ADAGRAD.flops
    # Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): per element g^2 into the row's sum,
    # then p -= multiplier * g; per row the mean, s += mean, multiplier = lr / (sqrt(s) + eps)
    assert count(lambda p, g, m: (reduce(g * g), p - m * g)) == Optimizer.ROWWISE_ADAGRAD.flops
    assert count(lambda total, d, s, lr, eps: (s2 := s + total / d, lr / (fn(s2) + eps))) == \
        Optimizer.ROWWISE_ADAGRAD.row_flops


def test_the_cost_memo_keys_on_every_attribute_op_cost_reads():
    """stg/builder.py memoises op_cost on COST_ATTRS: an attribute read but not listed would
    give two different ops one cached cost."""
    import re
    from pathlib import Path

    import stg.costs

    source = Path(stg.costs.__file__).read_text()
    read = set(re.findall(r"attrs\[\"(\w+)\"\]", source)) | set(re.findall(r"attrs\.get\(\"(\w+)\"", source))
    assert read <= set(stg.costs.COST_ATTRS), read - set(stg.costs.COST_ATTRS)
