"""Answer extraction and equivalence for rule-based math rewards.

Two steps: pull the final answer out of a free-form response (`\\boxed{}`, "#### X",
"The answer is X", the text after a reasoning block), then decide whether two answer strings
mean the same thing. Equivalence is decided on a normalised string first and, failing that,
numerically through a small restricted arithmetic evaluator: enough for fractions, mixed
numbers, decimals, percentages, thousands separators, units, and tuples/intervals compared
element-wise. When sympy is installed, expressions in one-letter variables are also compared
symbolically (`math_symbolic.py`); without it, they match only as text.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

from miles.rollout.rm_hub.math_symbolic import parse_quietly, symbolically_equal

# ---- extraction ---------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE_RE = re.compile(r"\\boxed\s+([^\s$]+)")
_ANSWER_IS_RE = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_HASH_RE = re.compile(r"####\s*(.+)")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _brace_content(text: str, open_pos: int) -> str | None:
    """Text between the `{` at `open_pos` and its matching `}`; None when unbalanced."""
    depth = 0
    for i in range(open_pos, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1 : i]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed) or `\\boxed X`; None if absent."""
    matches = list(_BOXED_RE.finditer(text))
    for m in reversed(matches):
        content = _brace_content(text, m.end() - 1)
        if content is not None:
            return content
    spaced = _BOXED_SPACE_RE.findall(text)
    return spaced[-1] if spaced else None


def _first_line_sentence(text: str) -> str:
    """Cut a phrase-introduced answer at the end of its line or sentence ("5. Then ..." -> "5")."""
    line = text.strip().split("\n", 1)[0]
    return re.split(r"\.\s", line, maxsplit=1)[0].strip()


def extract_answer_phrase(text: str) -> str | None:
    """X from the last "The (final) answer is X" / "Answer: X"."""
    matches = _ANSWER_IS_RE.findall(text)
    if not matches:
        return None
    answer = matches[-1]
    # "Final Answer: The final answer is 5." -- the greedy match swallowed a second phrase.
    while (inner := _ANSWER_IS_RE.findall(answer)) and inner[-1] != answer:
        answer = inner[-1]
    return _first_line_sentence(answer)


def extract_hash_answer(text: str) -> str | None:
    """X from the last "#### X" (GSM8K's answer marker)."""
    matches = _HASH_RE.findall(text)
    return _first_line_sentence(matches[-1]) if matches else None


def extract_last_number(text: str) -> str | None:
    matches = _NUMBER_RE.findall(text)
    return matches[-1].rstrip(",") if matches else None


def extract_math_answer(text: str) -> str:
    """Final answer of a math response: boxed > "answer is" > "####" > the whole text.

    Falling back to the whole text lets a bare answer ("1/2") match, while a long derivation
    without a marked answer normalises to something that matches no label.
    """
    for extract in (extract_boxed, extract_answer_phrase, extract_hash_answer):
        found = extract(text)
        if found is not None:
            return found
    return text


def strip_reasoning(text: str, end_tag: str = "</think>") -> str | None:
    """The text after the last reasoning block; None when the block is never closed."""
    pos = text.rfind(end_tag)
    return None if pos < 0 else text[pos + len(end_tag) :]


# ---- normalisation ------------------------------------------------------------------------

_UNITS = (
    "square units|sq units|units?|cm\\^?2|cm\\^?3|m\\^?2|m\\^?3|km|cm|mm|m|kg|mg|g|ml|l|liters?|litres?|"
    "seconds?|secs?|s|minutes?|mins?|hours?|hrs?|h|days?|weeks?|months?|years?|"
    "inches|inch|in|feet|foot|ft|yards?|yd|miles?|mi|mph|meters?|metres?|kilometers?|centimeters?|"
    "pounds?|lbs?|lb|ounces?|oz|grams?|kilograms?|dollars?|cents?|degrees?|deg|percent|points?|"
    "people|students|apples|items|times"
)
_UNIT_SUFFIX_RE = re.compile(rf"^(?P<value>.*?[\d}})\]])\s+(?:{_UNITS})(?:\^\{{?[23]\}}?)?\.?$", re.IGNORECASE)
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGN_RE = re.compile(r"^[a-zA-Z]\w*\s*=\s*(?=[^=])")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\(?:quad|qquad|displaystyle)|~")


# `2\frac{1}{2}` is two and a half, not a product: an integer written right before a proper
# fraction of integers (not after `.`, `^`, a letter or a bracket, where it is a factor).
_MIXED_NUMBER_RE = re.compile(
    r"(?<![\w.^})\]])(?P<whole>\d+)\s*\\[dt]?frac\s*(?:\{\s*(?P<num>\d+)\s*\}\s*\{\s*(?P<den>\d+)\s*\}|(?P<n1>\d)(?P<d1>\d))"
)


def _replace_mixed_number(s: str) -> str:
    """`2\\frac{1}{2}` -> `(2+(1)/(2))`; an improper fraction after an integer stays a product."""

    def mixed(m: re.Match[str]) -> str:
        num, den = m.group("num") or m.group("n1"), m.group("den") or m.group("d1")
        if not 0 < int(num) < int(den):
            return m.group(0)
        return f"({m.group('whole')}+({num})/({den}))"

    return _MIXED_NUMBER_RE.sub(mixed, s)


def _replace_frac(s: str) -> str:
    """`\\frac{a}{b}` -> `(a)/(b)`, innermost first; `\\frac12` -> `(1)/(2)`."""
    s = re.sub(r"\\[dt]?frac\s*(\d)\s*(\d)", r"(\1)/(\2)", s)
    s = re.sub(r"\\[dt]?frac\s*\{", r"\\frac{", s)
    while True:
        start = s.find("\\frac{")
        if start < 0:
            return s
        num = _brace_content(s, start + len("\\frac"))
        if num is None:
            return s
        den_open = start + len("\\frac") + len(num) + 2
        if den_open >= len(s) or s[den_open] != "{":
            return s
        den = _brace_content(s, den_open)
        if den is None:
            return s
        s = s[:start] + f"({num})/({den})" + s[den_open + len(den) + 2 :]


def _replace_sqrt(s: str) -> str:
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)
    return re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", s)


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer: no LaTeX wrappers, spacing, units, `$`, `%`, commas."""
    s = answer.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = s.replace("\\left", "").replace("\\right", "")
    s = _SPACING_RE.sub(" ", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("{,}", "")
    s = re.sub(r"\\(?:text|mathrm|mbox)\s*\{\s*(?:" + _UNITS + r")\s*\}(?:\^\{?[23]\}?)?", "", s, flags=re.IGNORECASE)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*")
    while _TEXT_RE.search(s):
        s = _TEXT_RE.sub(r"\1", s)
    s = s.strip().rstrip(".").strip()
    s = _ASSIGN_RE.sub("", s)
    unit = _UNIT_SUFFIX_RE.match(s)
    if unit:
        s = unit.group("value")
    s = _replace_sqrt(_replace_frac(_replace_mixed_number(s)))
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = re.sub(r"^\{(.*)\}$", r"\1", s)
    s = re.sub(r"^\(([A-Za-z])\)$", r"\1", s)  # multiple choice: "(B)" is "B"
    return _canonical_number(s)


def _canonical_number(s: str) -> str:
    """'5.0' -> '5', '0.50' -> '0.5', '+3' -> '3', '.5' -> '0.5'; other strings unchanged."""
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        value = Fraction(s.lstrip("+"))
        if value.denominator == 1:
            return str(value.numerator)
        return format(float(value), ".15g")
    return s


# ---- numeric evaluation -------------------------------------------------------------------

_MAX_RESULT_DIGITS = 10_000  # bounds the work a crafted "9^9^9" answer can cause
_ALLOWED_NAMES = {"pi": math.pi, "e": math.e}


def _eval_node(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value) if isinstance(node.value, int) else Fraction(repr(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ValueError("division by zero")
            return left / right
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
    if isinstance(node, ast.Name) and node.id in _ALLOWED_NAMES:
        return _ALLOWED_NAMES[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
    ):
        value = _eval_node(node.args[0])
        if value < 0:
            raise ValueError("sqrt of a negative number")
        root = math.sqrt(float(value))
        return Fraction(round(root)) if round(root) ** 2 == value else root
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def _power(base: Fraction | float, exponent: Fraction | float) -> Fraction | float:
    """Bounded, real-valued power: answers never need huge or complex results."""
    if abs(float(exponent)) * math.log10(abs(float(base)) + 1) > _MAX_RESULT_DIGITS:
        raise ValueError("power too large")
    integral = isinstance(exponent, Fraction) and exponent.denominator == 1
    if base == 0 and exponent < 0:
        raise ValueError("zero to a negative power")
    if base < 0 and not integral:
        raise ValueError("fractional power of a negative number")
    if integral and isinstance(base, Fraction):
        return base ** int(exponent)
    return float(base) ** float(exponent)


def evaluate_number(normalized: str) -> Fraction | float | None:
    """Value of a normalised arithmetic answer ("(1)/(2)", "-3", "2sqrt(3)"); None if not numeric."""
    if not normalized or len(normalized) > 200 or not re.fullmatch(r"[\d.+\-*/^(){}a-z]+", normalized):
        return None
    expr = normalized.replace("^", "**").replace("{", "(").replace("}", ")")
    # Implicit multiplication as written in answers: 2sqrt(3), 3pi, (1)(2).
    expr = re.sub(r"(?<=[\d)])(?=sqrt|pi|\()", "*", expr)
    expr = re.sub(r"(?<=\))(?=\d)", "*", expr)
    try:
        value = _eval_node(parse_quietly(expr).body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _numbers_equal(a: Fraction | float, b: Fraction | float) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)


# ---- tuples and intervals -----------------------------------------------------------------

_OPEN_TO_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _as_sequence(s: str) -> tuple[str, str, list[str]] | None:
    """('(', ')', ['1', '2']) for "(1,2)"; None when `s` is not a bracketed, comma-separated list."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return None
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and i < len(s) - 1:
            return None  # "(1)/(2)": the first bracket closes before the end
    items = _split_top_level(s[1:-1])
    return (s[0], s[-1], items) if len(items) > 1 else None


def _equal_normalized(a: str, b: str) -> bool:
    if a == b:
        return True
    seq_a, seq_b = _as_sequence(a), _as_sequence(b)
    if seq_a is not None or seq_b is not None:
        if seq_a is None or seq_b is None or seq_a[:2] != seq_b[:2] or len(seq_a[2]) != len(seq_b[2]):
            return False
        return all(_equal_normalized(x, y) for x, y in zip(seq_a[2], seq_b[2], strict=True))
    if a.count(",") and a.count(",") == b.count(","):  # bare lists "1,2" vs "1, 2.0"
        return all(_equal_normalized(x, y) for x, y in zip(a.split(","), b.split(","), strict=True))
    value_a, value_b = evaluate_number(a), evaluate_number(b)
    if value_a is not None and value_b is not None:
        return _numbers_equal(value_a, value_b)
    if value_a is not None or value_b is not None:
        # A number against something that is not one (text, or an expression in variables): sympy could only
        # tell them equal when the variables cancel, and parsing prose as a product of letters costs ~10 ms.
        return False
    return symbolically_equal(a, b)


def is_equiv(answer: str, reference: str) -> bool:
    """Whether two extracted answers are the same mathematical object."""
    a, b = normalize_answer(answer), normalize_answer(reference)
    if not a or not b:
        return False
    if _equal_normalized(a, b):
        return True
    lower_a, lower_b = a.lower(), b.lower()
    return (lower_a != a or lower_b != b) and _equal_normalized(lower_a, lower_b)
