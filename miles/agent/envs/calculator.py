"""Arithmetic in one or two steps with a calculator tool, at each of the three plug-in layers.

A task is an expression of one or two operations ("What is 14 * 6?", "What is (12 + 7) * 3?").
The model may call the tool `calculator` with {"expression": ...} and gets the value back as a
tool message. Its final answer is "Answer: N", or else the number after the last "=" of a reply
("18 * 7 = 126"), or a reply that is just a number. A reply with neither a call nor an answer
gets a one-line reminder as a user turn. The episode ends at an answer, at the turn limit
(`--generate-max-turns`) or at the length limit. Reward: 1.0 when the final answer of the last
assistant turn equals the label, else 0.0.

    --custom-agent-function-path miles.agent.envs.calculator.agent --use-session-server --tito-model chatml
    --custom-generate-function-path miles.agent.envs.calculator.generate
    --rollout-function-path miles.agent.envs.calculator.CalculatorRollout
    (the first two with --custom-rm-path miles.agent.envs.calculator.reward)

    python -m miles.agent.envs.calculator --out-dir launch/data     # rewrites the committed task files
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import random
import re
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import aiohttp

from miles.agent.families import FAMILIES
from miles.agent.gateway_client import generate_tokens
from miles.agent.plugins import (
    GenerateFnInput,
    GenerateFnOutput,
    GenerateState,
    RolloutFnConstructorInput,
    RolloutFnTrainInput,
    RolloutFnTrainOutput,
)
from miles.agent.tito import TitoTokenizer
from miles.agent.trajectory import Trajectory
from miles.rollout.sample import Sample

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. You can use the calculator tool. "
    "When you know the result, reply with 'Answer: <number>'."
)
REMINDER = "Use the calculator tool, or reply with 'Answer: <number>'."
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
ONE_OP = ("{a} + {b}", "{a} - {b}", "{a} * {c}")
TWO_OPS = ("({a} + {b}) * {c}", "{a} * {c} + {b}", "{a} + {b} - {c}", "({a} - {b}) * {c}")
FORMS = ONE_OP + TWO_OPS  # the held-out set draws these uniformly (3 of 7 one operation)
TRAIN_ONE_OP_FRAC = 0.75  # the training set leans on one operation, which the base model sometimes solves
_NUMBER = r"-?\d+(?:\.\d+)?"
_ANSWER = re.compile(rf"Answer:\s*({_NUMBER})")
_FIRST_NUMBER = re.compile(_NUMBER)
_ONLY_NUMBER = re.compile(rf"\s*({_NUMBER})\s*\.?\s*")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


# ---------------------------------------------------------------- the tool and the grade


def calculate(expression: str) -> str:
    """The value of + - * / and parentheses over numbers, as text; "error: ..." for anything else."""
    try:
        value = _eval(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_eval(node.operand) if isinstance(node.op, ast.USub) else _eval(node.operand)
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")


def final_answer(text: str) -> float | None:
    """The last `Answer: N`, else the number after the last "=", else a reply that is only a number."""
    text = text or ""
    found = _ANSWER.findall(text)
    if found:
        return float(found[-1])
    if "=" in text:
        after = _FIRST_NUMBER.search(text.rpartition("=")[2])
        return float(after.group(0)) if after else None
    only = _ONLY_NUMBER.fullmatch(text)
    return float(only.group(1)) if only else None


def score(text: str, label: str) -> float:
    answer = final_answer(text)
    return float(answer is not None and abs(answer - float(label)) < 1e-6)


def last_reply(sample: Sample) -> str:
    """The text of the episode's last assistant turn (the whole response when no messages were kept)."""
    replies = [m for m in sample.metadata.get("messages") or [] if m.get("role") == "assistant"]
    return (replies[-1].get("content") or "") if replies else sample.response


async def reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """`--custom-rm-path miles.agent.envs.calculator.reward`: the final answer of the last assistant turn."""
    return score(last_reply(sample), sample.label)


# ---------------------------------------------------------------- the episode, shared by the layers


def first_messages(prompt: str | list[dict]) -> list[dict]:
    user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return [{"role": "system", "content": SYSTEM_PROMPT}, *user]


@dataclass(slots=True)
class Step:
    messages: list[dict]  # what the environment appends (tool results or a reminder)
    done: bool
    tool_s: float
    tool_calls: int


def respond(reply: dict) -> Step:
    """The environment's answer to one assistant message."""
    calls = reply.get("tool_calls") or []
    if calls:
        start = time.perf_counter()
        out = [{"role": "tool", "tool_call_id": c.get("id"), "content": _run_call(c)} for c in calls]
        return Step(out, False, time.perf_counter() - start, len(calls))
    if final_answer(reply.get("content") or "") is not None:
        return Step([], True, 0.0, 0)
    return Step([{"role": "user", "content": REMINDER}], False, 0.0, 0)


def _run_call(call: dict) -> str:
    fn = call.get("function") or {}
    if fn.get("name") != "calculator":
        return f"error: no tool named {fn.get('name')!r}; the tool is calculator"
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    return calculate(args.get("expression", "")) if isinstance(args, dict) else "error: arguments must be an object"


# ---------------------------------------------------------------- layer 1: the agent function


async def agent(base_url: str, prompt: Any, request_kwargs: dict, metadata: dict, **kwargs: Any) -> dict:
    """Talks to `{base_url}/v1/chat/completions` like any OpenAI-API agent; the session server records tokens."""
    async with aiohttp.ClientSession() as http:
        _, metrics = await run_episode(
            http, base_url, first_messages(prompt), request_kwargs, int(metadata.get("max_turns", 4))
        )
    return {"agent_metrics": metrics}


async def run_episode(
    http: aiohttp.ClientSession, base_url: str, messages: list[dict], request_kwargs: dict, max_turns: int
) -> tuple[list[dict], dict[str, float]]:
    """One episode over an OpenAI-compatible endpoint: (the messages, with every reply, and the metrics)."""
    turns = tool_calls = 0
    tool_s = 0.0
    while turns < max_turns:
        body = {"model": "policy", "messages": messages, "tools": [TOOL], **request_kwargs}
        async with http.post(f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:  # refused or aborted: the episode ends with what it has
                break
            choice = (await resp.json())["choices"][0]
        turns += 1
        reply = {k: v for k, v in choice["message"].items() if v is not None}
        messages.append(reply)
        if choice["finish_reason"] == "length":
            break
        step = respond(reply)
        tool_s, tool_calls = tool_s + step.tool_s, tool_calls + step.tool_calls
        if step.done:
            break
        messages += step.messages
    return messages, {"total_tool_time": tool_s, "turns": turns, "tool_calls": tool_calls}


# ---------------------------------------------------------------- layer 2: the generate function


@lru_cache(maxsize=4)
def _tito(tokenizer: Any) -> TitoTokenizer:
    return TitoTokenizer(FAMILIES["chatml"], tokenizer)


async def generate(input: GenerateFnInput) -> GenerateFnOutput:
    """Drives the engine token by token (the router's /generate) and records the trajectory itself."""
    args, sample = input.args, input.sample
    tito = _tito(input.state.tokenizer)
    messages = first_messages(sample.prompt)
    context = getattr(args, "rollout_max_context_len", None) or getattr(args, "engine_context_len", None)
    traj = Trajectory(tito.prompt_ids(messages, [TOOL]), max_len=context)
    key = sample.routing_key or uuid.uuid4().hex
    stop_ids = {*input.sampling_params.get("stop_token_ids", ()), tito.end_of_turn_id}
    params = {**input.sampling_params, "stop_token_ids": sorted(stop_ids)}
    async with aiohttp.ClientSession() as http:
        while traj.turns < int(args.generate_max_turns):
            room = traj.room()
            max_new = params["max_new_tokens"] if room is None else min(params["max_new_tokens"], room)
            if max_new <= 0:
                traj.finish = "length"
                break
            out = await generate_tokens(
                http, args, traj.token_ids, {**params, "max_new_tokens": max_new}, routing_key=key
            )
            traj.add_model_turn(*out)
            ids, finish = out[0], out[3]
            if finish != "stop":
                break
            reply = tito.parse_reply(ids)
            messages.append(reply)
            step = respond(reply)
            traj.tool_time_s += step.tool_s
            if step.done or traj.turns >= int(args.generate_max_turns):
                break
            stored = len(messages)
            messages += step.messages
            closed = bool(ids) and ids[-1] == tito.end_of_turn_id
            traj.add_env_tokens(tito.suffix_ids(messages, stored, [TOOL], closed_turn=closed))
            if traj.finish == "length":
                break
    traj.fill(sample, input.state.tokenizer)
    sample.metadata["messages"] = messages
    return GenerateFnOutput(sample)


# ---------------------------------------------------------------- layer 3: the rollout function


class CalculatorRollout:
    """Replaces the whole rollout: draws its tasks, runs every episode, grades them itself."""

    def __init__(self, input: RolloutFnConstructorInput) -> None:
        from transformers import AutoTokenizer

        self.args = input.args
        self.data_source = input.data_source
        a = self.args
        self.sampling = {
            "temperature": a.rollout_temperature,
            "top_p": a.rollout_top_p,
            "top_k": a.rollout_top_k,
            "min_p": a.rollout_min_p,
            "max_new_tokens": a.rollout_max_response_len,
            "stop": list(a.rollout_stop or []),
            "stop_token_ids": list(a.rollout_stop_token_ids or []),
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        tokenizer = AutoTokenizer.from_pretrained(a.hf_checkpoint, trust_remote_code=a.trust_remote_code)
        self.state = GenerateState(a, tokenizer, self.sampling)

    async def __call__(self, input: RolloutFnTrainInput) -> RolloutFnTrainOutput:
        groups = self.data_source.get_samples(self.args.rollout_batch_size)
        await asyncio.gather(*(self._episode(s) for g in groups for s in g))
        samples = [s for g in groups for s in g]
        solved = [s.reward for s in samples]
        turns = [s.metadata.get("num_turns", 0) for s in samples]
        metrics = {
            "rollout/calculator/solved_frac": sum(solved) / len(solved),
            "rollout/calculator/turns_mean": sum(turns) / len(turns),
        }
        return RolloutFnTrainOutput(groups, metrics)

    async def _episode(self, sample: Sample) -> None:
        sample.routing_key = uuid.uuid4().hex
        await generate(GenerateFnInput(self.state, sample, dict(self.sampling)))
        sample.reward = score(last_reply(sample), sample.label)


# ---------------------------------------------------------------- task files


def make_problem(rng: random.Random, one_op_frac: float | None = None) -> tuple[str, int]:
    """An expression and its value; `one_op_frac` None draws the forms uniformly, else one operation that often."""
    if one_op_frac is None:
        form = rng.choice(FORMS)
    else:
        form = rng.choice(ONE_OP if rng.random() < one_op_frac else TWO_OPS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
    if "-" in form and a < b:
        a, b = b, a
    expression = form.format(a=a, b=b, c=c)
    return expression, int(float(calculate(expression)))


def write_tasks(
    path: Path, n: int, rng: random.Random, exclude: set[str], one_op_frac: float | None = None
) -> set[str]:
    seen: set[str] = set()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        while len(seen) < n:
            expression, answer = make_problem(rng, one_op_frac)
            if expression in seen or expression in exclude:
                continue
            seen.add(expression)
            row = {"messages": [{"role": "user", "content": f"What is {expression}?"}], "label": str(answer)}
            f.write(json.dumps(row) + "\n")
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write calculator train / held-out JSONL task files.")
    parser.add_argument("--out-dir", default="launch/data")
    parser.add_argument("--num-train", type=int, default=512)
    parser.add_argument("--num-eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-one-op-frac",
        type=float,
        default=TRAIN_ONE_OP_FRAC,
        help="share of one-operation tasks in the training file (the held-out file draws all forms uniformly)",
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.train_one_op_frac <= 1.0:
        parser.error(f"--train-one-op-frac {args.train_one_op_frac} must be within [0, 1]")
    rng = random.Random(args.seed)
    held_out = write_tasks(Path(args.out_dir) / "calculator_eval.jsonl", args.num_eval, rng, set())
    write_tasks(Path(args.out_dir) / "calculator_train.jsonl", args.num_train, rng, held_out, args.train_one_op_frac)
    print(f"wrote {args.num_train} + {args.num_eval} tasks to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
