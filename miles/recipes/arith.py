"""Verifiable arithmetic for a small instruct model: generated offline, graded exactly.

Problems are `a + b`, `a - b` (never negative) and `a * b` with small operands, asked as chat
messages ("What is 14 + 9?"). Small instruct models answer in the form "14 + 9 = 23", so the
answer is the number after the first "="; a response without "=" is graded by the project's math
rule (a bare number, "\\boxed{23}", "the answer is 23"). Either way the final comparison is
`grade("math", answer, label)`, the rule every other math recipe uses.

    python -m miles.recipes.arith --out-dir launch/data          # rewrites the committed files
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.rollout.rm_hub import grade

logger = logging.getLogger(__name__)

OPERATORS = ("+", "-", "*")
PROMPT_TEMPLATE = "What is {expression}?"
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(slots=True, frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        raise ValueError(f"operator {self.op!r} is not one of {OPERATORS}")

    def to_row(self) -> dict[str, Any]:
        """One JSONL row: chat messages under "messages", the exact answer under "label"."""
        content = PROMPT_TEMPLATE.format(expression=self.expression)
        return {"messages": [{"role": "user", "content": content}], "label": str(self.answer)}


def sample_problem(rng: random.Random, max_operand: int = 20, max_factor: int = 9) -> Problem:
    """One problem; subtraction keeps a >= b, multiplication uses one-digit factors."""
    op = rng.choice(OPERATORS)
    if op == "*":
        return Problem(rng.randint(2, max_factor), op, rng.randint(2, max_factor))
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    return Problem(a, op, b)


def make_splits(
    num_train: int, num_eval: int, seed: int = 0, max_operand: int = 20
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out problem lists (no expression appears in both)."""
    space = 3 * max_operand * max_operand
    if num_eval > space // 4:
        raise ValueError(f"num_eval={num_eval} is too large for max_operand={max_operand}; raise max_operand")
    rng = random.Random(seed)
    held_out: dict[str, Problem] = {}
    while len(held_out) < num_eval:
        p = sample_problem(rng, max_operand)
        held_out.setdefault(p.expression, p)
    train: list[Problem] = []
    while len(train) < num_train:
        p = sample_problem(rng, max_operand)
        if p.expression not in held_out:
            train.append(p)
    return train, list(held_out.values())


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for p in problems:
            f.write(json.dumps(p.to_row()) + "\n")
    return out


def extract_answer(response: str) -> str:
    """The number after the first "=" ("14 + 9 = 23 ..." -> "23"); without "=", the whole response."""
    head, sep, tail = response.partition("=")
    if not sep:
        return response
    found = _NUMBER_RE.search(tail)
    return found.group(0) if found else ""


def score(response: str, label: str) -> float:
    """1.0 for the right number (after "=", bare, boxed or "the answer is N"), else 0.0."""
    return grade("math", extract_answer(response), label)


def score_steps(response: str, label: str) -> float:
    """Step-by-step work ("3 + 4 = 7", "7 * 2 = 14", ...): 1.0 when the number after the last "=" is right."""
    head, sep, tail = response.rpartition("=")
    found = _NUMBER_RE.search(tail) if sep else None
    return grade("math", found.group(0), label) if found else 0.0


async def reward(args: Any, sample: Any, **kwargs: Any) -> float:
    """`--custom-rm-path miles.recipes.arith.reward`."""
    return score(sample.response, sample.label)


async def reward_steps(args: Any, sample: Any, **kwargs: Any) -> float:
    """`--custom-rm-path miles.recipes.arith.reward_steps`: multi-step problems graded on the last step."""
    return score_steps(sample.response, sample.label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write arithmetic train / held-out JSONL files.")
    parser.add_argument("--out-dir", default="launch/data")
    parser.add_argument("--num-train", type=int, default=512)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    train, held_out = make_splits(args.num_train, args.num_eval, args.seed, args.max_operand)
    for name, problems in (("arith_train.jsonl", train), ("arith_eval.jsonl", held_out)):
        path = write_jsonl(problems, Path(args.out_dir) / name)
        print(f"wrote {len(problems)} problems to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
