"""The calculator environment: the tool, the answer it accepts, the environment's reply to each turn."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from miles.agent.envs.calculator import REMINDER, calculate, final_answer, main, make_problem, respond, reward
from miles.rollout.sample import Sample


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 7) * 3", "57"),
        ("10 / 4", "2.5"),
        ("-3 + 5", "2"),
        ("2 ** 10", "error"),
        ("1 / 0", "error"),
        ("__import__('os')", "error"),
        ("", "error"),
    ],
)
def test_the_tool_evaluates_arithmetic_and_nothing_else(expression: str, value: str):
    assert calculate(expression).startswith(value)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Answer: 12", 12.0),
        ("Answer: 3, no, Answer: 4", 4.0),
        ("18 * 7 = 126.", 126.0),
        (" 48. ", 48.0),
        ("(8 + 10) * 7 = 18 * 7 = 126 I think", 126.0),
        ("I have 12 apples", None),
        ("x =", None),
        ("", None),
    ],
)
def test_final_answer_forms(text: str, answer: float | None):
    assert final_answer(text) == answer


def test_problems_are_labelled_by_the_tool():
    for expression, answer in (make_problem(random.Random(seed)) for seed in range(50)):
        assert str(answer) == calculate(expression) and answer >= 0


def test_the_environment_runs_calls_reminds_and_stops():
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "6 * 7"})},
    }
    step = respond({"role": "assistant", "content": None, "tool_calls": [call]})
    assert [m["content"] for m in step.messages] == ["42"] and step.messages[0]["tool_call_id"] == "c"
    assert not step.done and step.tool_calls == 1
    wrong_tool = respond(
        {"role": "assistant", "tool_calls": [{**call, "function": {"name": "search", "arguments": "{}"}}]}
    )
    assert "no tool named 'search'" in wrong_tool.messages[0]["content"]
    assert respond({"role": "assistant", "content": "hmm"}).messages == [{"role": "user", "content": REMINDER}]
    assert respond({"role": "assistant", "content": "Answer: 42"}).done


def test_reward_grades_the_last_assistant_turn_not_tool_output():
    messages = [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "= 42"},
        {"role": "user", "content": REMINDER},
        {"role": "assistant", "content": "Answer: 41"},
    ]
    sample = Sample(label="42", response="= 42 ... Answer: 41", metadata={"messages": messages})
    assert asyncio.run(reward(None, sample)) == 0.0
    sample.metadata["messages"] = messages[:2]
    assert asyncio.run(reward(None, sample)) == 1.0


def _one_op_share(path) -> float:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    one = [r for r in rows if sum(r["messages"][0]["content"].count(op) for op in "+-*") == 1]
    return len(one) / len(rows)


def test_the_training_file_leans_on_one_operation_and_the_held_out_file_does_not(tmp_path):
    assert main(["--out-dir", str(tmp_path), "--num-train", "200", "--num-eval", "100"]) == 0
    assert _one_op_share(tmp_path / "calculator_train.jsonl") > 0.6  # drawn 3:1, repeats dropped
    assert _one_op_share(tmp_path / "calculator_eval.jsonl") < 0.55  # the seven forms uniformly: 3/7
    main(["--out-dir", str(tmp_path), "--num-train", "50", "--num-eval", "10", "--train-one-op-frac", "0"])
    assert _one_op_share(tmp_path / "calculator_train.jsonl") == 0.0
    with pytest.raises(SystemExit):
        main(["--out-dir", str(tmp_path), "--train-one-op-frac", "1.5"])
