"""stg/numeric.py: compiled size expressions give sympy's exact values."""

from fractions import Fraction

import sympy

from stg.lower import Evaluator
from stg.numeric import compiled, exact, value

H, B, S, T, D = sympy.symbols("H B S tp dp", positive=True, integer=True)


def test_a_compiled_expression_is_exact_where_floats_are_not():
    """2^53 + 1 is not a float: a compiled product keeps it, and a quotient stays a fraction
    (ceil((2^53 + 1) / 3) by hand: 2^53 + 1 = 3 x 3,002,399,751,580,331)."""
    numbers = {H: 2**53 + 1, T: 3}
    assert value(H / T, numbers) == Fraction(2**53 + 1, 3) == 3_002_399_751_580_331
    assert Evaluator({H: 2**53 + 1, T: 2})(H / T) == 2**52 + 1  # the ceiling of 2^52 + 1/2
    assert float(2**53 + 1) == 2**53  # what a float evaluation would have said


def test_compiled_values_equal_sympys():
    expressions = [2 * B * S * H**2 / T, (H + 7) * B / (T * D), sympy.Rational(3, 8) * H * S / D + B,
                   H**3 / T**2 - S, sympy.Integer(5), 12 * H * (H + 1) / (T * D)]
    bindings = {H: 16384, B: 3, S: 8192, T: 7, D: sympy.Rational(5, 2)}
    numbers = {k: exact(sympy.sympify(v)) for k, v in bindings.items()}
    for expr in expressions:
        assert value(expr, numbers) == sympy.sympify(expr).xreplace(bindings)
        assert Evaluator(bindings)(expr) == int(sympy.ceiling(expr.xreplace(bindings)))


def test_what_is_not_a_polynomial_is_left_to_sympy():
    for expr in (sympy.ceiling(H / T), sympy.Max(H, S), sympy.sqrt(H)):
        assert compiled(expr) is None
    assert Evaluator({H: 10, T: 4})(sympy.ceiling(H / T) * 2) == 6
    assert value(H * S, {H: 3}) is None  # S unbound: sympy says so
    assert exact(sympy.Float(0.5)) is None
