"""Size expressions from files other people wrote: parsed, never evaluated.

A shape or size in a model file (`H`, `A*Dh`, `(K*CF*B*S)/E`, `4096`) is read with Python's
own parser (`ast.parse` builds a syntax tree and runs nothing) and accepted only if every
node is a name, a non-negative integer literal, a unary sign or one of `+ - * /`. Names are
looked up in the caller's table of declared symbols; anything else (calls, attributes,
subscripts, lambdas, strings, floats, `**`) is refused with a one-line error. `sympy.sympify`
is never called on user text: it runs `eval`.
"""

from __future__ import annotations

import ast
import keyword
import operator
from typing import Callable, Mapping

import sympy

MAX_LENGTH = 200  # characters; a size expression is a short product, and this bounds the parse

# Names sympy's parser gives a meaning (sympy.abc._clash: I is sqrt(-1), Q the assumptions
# module, N a function, ...), refused as dimension names so that no reader of a description
# can take one for sympy's. E (the experts, as in model_zoo/moe.py) and S (the sequence) are
# stg's own symbols.
SYMPY_NAMES = frozenset({"I", "N", "O", "Q", "beta", "gamma", "pi", "zeta"})

_BINARY: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                 ast.Div: operator.truediv}
_UNARY: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


_NOT_A_SIZE = "not a size expression (allowed: names, integers, + - * / and parentheses)"


class ExprError(ValueError):
    """Not a size expression; the message says why (the caller names the field)."""


def check_name(name: object, reserved: frozenset[str] = frozenset()) -> str:
    """`name` if it can name a dimension: an identifier, no keyword, no leading underscore, not
    one of sympy's names nor of `reserved`; else ExprError."""
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise ExprError(f"{name!r} is not a name (letters, digits and _, not starting with a digit)")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise ExprError(f"{name!r} is a Python keyword")
    if name.startswith("_"):
        raise ExprError(f"{name!r} starts with an underscore")
    if name in SYMPY_NAMES or name in reserved:
        raise ExprError(f"{name!r} is reserved; choose another name")
    return name


def parse_size(text: object, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    """The sympy expression of a size: an integer, or `text` over the names in `symbols`."""
    if isinstance(text, bool):
        raise ExprError(f"expected a size, got {text!r}")
    if isinstance(text, int):
        return sympy.Integer(text)
    if not isinstance(text, str):
        raise ExprError(f"expected a size (a name, an integer or an expression of them), got {text!r}")
    if len(text) > MAX_LENGTH:
        raise ExprError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ExprError(_NOT_A_SIZE) from None
    return _build(tree.body, text, symbols)


def _build(node: ast.AST, text: str, symbols: Mapping[str, sympy.Symbol]) -> sympy.Expr:
    if isinstance(node, ast.Name):
        if node.id not in symbols:
            raise ExprError(f"unknown name {node.id!r}; declared: {sorted(symbols)}")
        return symbols[node.id]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return sympy.Integer(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_build(node.left, text, symbols), _build(node.right, text, symbols))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_build(node.operand, text, symbols))
    raise ExprError(_NOT_A_SIZE)
