"""Size expressions compiled once into exact Python arithmetic (issue 12, "costs are compiled
once"): binding a plan then calls a function of its symbols' values instead of rebuilding a
sympy tree per expression.

Exact: integers stay integers and a quotient is a fractions.Fraction, so a value is the one
sympy's `xreplace` and `ceiling` give. Only sums, products and integer powers of symbols and
rational numbers are compiled (all the graph's FLOP, byte and size expressions); anything else
(a ceiling, a maximum) is None here and left to sympy.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Callable, Mapping

import sympy


class _NotCompiled(Exception):
    pass


def _quotient(above: int | Fraction, below: int | Fraction) -> int | Fraction:
    """above / below, exactly: an int where it divides (most sizes do: a Fraction costs its
    gcd), else a Fraction."""
    if type(above) is int and type(below) is int:
        whole, rest = divmod(above, below)
        if not rest:
            return whole
    return Fraction(above, below)


def _source(expr: sympy.Basic, names: dict[sympy.Symbol, str], constants: dict[str, Fraction]) -> str:
    if expr.is_Integer:
        return repr(int(expr))
    if expr.is_Rational:  # made once, a global of the compiled function
        name = f"c{len(constants)}"
        constants[name] = Fraction(int(expr.p), int(expr.q))
        return name
    if expr.is_Symbol:
        return names.setdefault(expr, f"v{len(names)}")
    if expr.is_Add:
        return "(" + " + ".join(_source(term, names, constants) for term in expr.args) + ")"
    if expr.is_Mul:
        above, below = [], []
        for factor in expr.args:
            if factor.is_Pow and factor.exp.is_Integer and factor.exp < 0:
                below.append(_source(factor.base ** -factor.exp, names, constants))
            else:
                above.append(_source(factor, names, constants))
        product = " * ".join(above) or "1"
        return f"_Q({product}, {' * '.join(below)})" if below else f"({product})"
    if expr.is_Pow and expr.exp.is_Integer:
        base = _source(expr.base, names, constants)
        return f"({base} ** {int(expr.exp)})" if expr.exp >= 0 else f"_Q(1, {base} ** {-int(expr.exp)})"
    raise _NotCompiled


@functools.lru_cache(maxsize=1 << 16)  # the distinct expressions of a process's structures
def compiled(expr: sympy.Expr) -> tuple[Callable, tuple[sympy.Symbol, ...]] | None:
    """(f, symbols) such that f(*their values) is `expr`'s exact value, the values ints or
    Fractions; None when `expr` is not a sum of products of powers (see above)."""
    names: dict[sympy.Symbol, str] = {}
    constants: dict[str, Fraction] = {}
    try:
        body = _source(sympy.sympify(expr), names, constants)
    except _NotCompiled:
        return None
    return eval(f"lambda {', '.join(names.values())}: {body}", {"_Q": _quotient, **constants}), tuple(names)


def value(expr: sympy.Expr, numbers: Mapping[sympy.Symbol, int | Fraction]) -> int | Fraction | None:
    """`expr`'s exact value under `numbers` (exact bindings, see `exact`), or None where it is
    not compiled or holds a symbol that `numbers` lacks (sympy then decides)."""
    found = compiled(expr)
    if found is None:
        return None
    function, symbols = found
    try:
        return function(*[numbers[symbol] for symbol in symbols])
    except (KeyError, ZeroDivisionError):  # a symbol without an exact value, or a zero size
        return None


def exact(value: sympy.Basic) -> int | Fraction | None:
    """A binding as a Python number, or None when it is not an exact rational."""
    if value.is_Integer:
        return int(value)
    if value.is_Rational:
        return Fraction(int(value.p), int(value.q))
    return None


def bound(expr: sympy.Expr, numbers: Mapping, bindings: Mapping) -> int | Fraction | sympy.Expr:
    """`expr`'s value: compiled under `numbers` (exact bindings) where it can be, else sympy's
    under `bindings`, as an exact number where it is one."""
    found = value(expr, numbers)
    if found is None:
        found = sympy.sympify(expr).xreplace(bindings)
        if not found.is_number:
            raise AssertionError(f"unbound symbols {found.free_symbols} in {expr}")
        found = exact(found) if exact(found) is not None else found
    return found


def ceiling(number: int | Fraction | sympy.Expr) -> int:
    return math.ceil(number) if isinstance(number, (int, Fraction)) else int(sympy.ceiling(number))
