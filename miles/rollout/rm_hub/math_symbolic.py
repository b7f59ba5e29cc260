"""Symbolic equivalence of simple answer expressions, when sympy is installed.

`x+1` and `1+x`, `2(x+1)` and `2x+2`, `(x^2-1)/(x-1)` and `x+1` are the same answer, yet neither
their text nor a number tells. This module compares such expressions with sympy after
`normalize_answer` has run. Answers are model output, so they are never handed to sympy's parser
(which evaluates Python): the string is parsed with `ast` and only numbers, one-letter variables,
`pi`, `e`, `sqrt` and `+ - * / ^` are rebuilt as sympy objects, with bounded powers and length.
sympy is optional here (torch installs it); without it, `symbolically_equal` is always False and
grading is what it was.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import warnings
from types import ModuleType
from typing import Any

_MAX_CHARS = 120
_MAX_EXPONENT = 32  # (x+1)^32 expands quickly; 9^9^9 is refused, not computed
_ALLOWED_RE = re.compile(r"[\d.+\-*/^(){}a-zA-Z]+")
_WORD_RE = re.compile(r"[a-zA-Z]{2,}")
_KNOWN_WORDS = {"sqrt", "pi"}
_KNOWN_WORD_RE = re.compile("|".join(sorted(_KNOWN_WORDS, key=len, reverse=True)))
# More distinct letters than this is prose read as a product of one-letter variables ("the sum of 16 and
# 11" -> t*h*e*s*u*m*...), not an answer; expanding it costs sympy a third of a second.
_MAX_SYMBOLS = 8


@functools.cache
def _sympy() -> ModuleType | None:
    """sympy when it can be imported; None otherwise (it is an optional dependency)."""
    try:
        return importlib.import_module("sympy")
    except ImportError:
        return None


_TOKEN_RE = re.compile(r"\d+\.?\d*|\.\d+|sqrt|pi|[a-zA-Z]|\*\*|[+\-*/()]")


def _to_python_syntax(normalized: str) -> str | None:
    """`2ab^{2}+3(x+1)` -> `2*a*b**(2)+3*(x+1)`; None for a bare word ("yes" is not y*e*s)."""
    if _WORD_RE.fullmatch(normalized) and normalized not in _KNOWN_WORDS:
        return None  # read as a product, "yes" would equal "sey"
    tokens = _TOKEN_RE.findall(normalized.replace("^", "**").replace("{", "(").replace("}", ")"))
    out: list[str] = []
    for token in tokens:
        # Implicit multiplication as written in answers: 2x, 2(x+1), x(x+1), (x)(y), 2sqrt(x), 3pi.
        if out and _ends_factor(out[-1]) and _starts_factor(token):
            out.append("*")
        out.append(token)
    return "".join(out)


def _ends_factor(token: str) -> bool:
    return token == ")" or token[0].isdigit() or token[0] == "." or (token.isalpha() and token != "sqrt")


def _starts_factor(token: str) -> bool:
    return token == "(" or token[0].isdigit() or token[0] == "." or token.isalpha()


def _build(node: ast.AST, sp: ModuleType) -> Any:
    """Rebuild a parsed expression as sympy objects; ValueError on anything outside the grammar."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return sp.Integer(node.value) if isinstance(node.value, int) else sp.Rational(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _build(node.operand, sp)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        left, right = _build(node.left, sp), _build(node.right, sp)
        if isinstance(node.op, ast.Pow):
            if not right.is_number or abs(float(right)) > _MAX_EXPONENT:
                raise ValueError("exponent not a small number")
            return left**right
        ops = {ast.Add: left.__add__, ast.Sub: left.__sub__, ast.Mult: left.__mul__, ast.Div: left.__truediv__}
        return ops[type(node.op)](right)
    if isinstance(node, ast.Name):
        if node.id == "pi":
            return sp.pi
        if node.id == "e":
            return sp.E  # as in the numeric evaluator
        if len(node.id) == 1:
            return sp.Symbol(node.id)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
    ):
        return sp.sqrt(_build(node.args[0], sp))
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def parse_quietly(expr: str) -> ast.Expression:
    """`ast.parse(expr, mode="eval")` without the SyntaxWarnings model output provokes ("2x": invalid
    decimal literal), which would otherwise print once per graded answer."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(expr, mode="eval")


def _parse(normalized: str, sp: ModuleType) -> Any | None:
    if len(normalized) > _MAX_CHARS or not _ALLOWED_RE.fullmatch(normalized):
        return None
    if len({c for c in _KNOWN_WORD_RE.sub("", normalized) if c.isalpha()}) > _MAX_SYMBOLS:
        return None
    expr = _to_python_syntax(normalized)
    if expr is None:
        return None
    try:
        value = _build(parse_quietly(expr).body, sp)
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None
    return None if value.has(sp.zoo, sp.nan, sp.oo, -sp.oo) else value


def symbolically_equal(a: str, b: str) -> bool:
    """Whether two normalised answers are the same expression; False without sympy or when unsure."""
    sp = _sympy()
    if sp is None:
        return False
    left, right = _parse(a, sp), _parse(b, sp)
    if left is None or right is None or not (left.free_symbols or right.free_symbols):
        return False  # plain numbers are the numeric evaluator's job
    difference = left - right
    return sp.expand(difference) == 0 or sp.cancel(sp.together(difference)) == 0
