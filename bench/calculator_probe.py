"""How often a model's calculator episodes call the tool, answer, and answer right (before any training).

Runs the calculator environment's own episode (`miles.agent.envs.calculator.run_episode`: the same
messages, tool and replies as the agent function) against a running `miles session serve`, in
groups of --n-samples per task like a GRPO step, and prints the rates and how many groups have
mixed rewards (the groups GRPO can learn from).

    miles session serve --model-path DIR --port 30417 --tito-model chatml --max-tokens 64 &
    python bench/calculator_probe.py --base-url http://127.0.0.1:30417 --num-tasks 8 --n-samples 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

import aiohttp

from miles.agent.envs.calculator import final_answer, first_messages, run_episode, score


async def probe(args: argparse.Namespace) -> list[dict]:
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    tasks = random.Random(args.seed).sample(rows, args.num_tasks)
    kwargs = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    limit = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession() as http:

        async def one(group: int, row: dict) -> dict:
            start = first_messages(row["messages"])  # kept: the task and what the episode added
            async with limit:
                messages, metrics = await run_episode(http, args.base_url, list(start), dict(kwargs), args.max_turns)
            return {"group": group, "label": row["label"], "messages": messages[len(start) - 1 :], **metrics}

        jobs = [one(g, row) for g, row in enumerate(tasks) for _ in range(args.n_samples)]
        return await asyncio.gather(*jobs)


def summarise(episodes: list[dict]) -> dict[str, float]:
    n = len(episodes)
    replies = [[m for m in e["messages"] if m.get("role") == "assistant"] for e in episodes]
    last = [(r[-1].get("content") or "") if r else "" for r in replies]
    correct = [score(text, e["label"]) for text, e in zip(last, episodes, strict=True)]
    groups: dict[int, list[float]] = {}
    for e, r in zip(episodes, correct, strict=True):
        groups.setdefault(e["group"], []).append(r)
    return {
        "episodes": n,
        "tool_call_frac": sum(any(m.get("tool_calls") for m in r) for r in replies) / n,
        "tool_ok_frac": sum(_tool_ok(e["messages"]) for e in episodes) / n,
        "answer_frac": sum(final_answer(t) is not None for t in last) / n,
        "correct_frac": sum(correct) / n,
        "mixed_group_frac": sum(len(set(g)) > 1 for g in groups.values()) / len(groups),
        "turns_mean": sum(e["turns"] for e in episodes) / n,
    }


def _tool_ok(messages: list[dict]) -> bool:
    return any(m.get("role") == "tool" and not str(m.get("content", "")).startswith("error") for m in messages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30417")
    parser.add_argument("--data", default="launch/data/calculator_train.jsonl")
    parser.add_argument("--num-tasks", type=int, default=8)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", help="write every episode's messages to this JSONL file")
    args = parser.parse_args(argv)
    episodes = asyncio.run(probe(args))
    if args.dump:
        Path(args.dump).write_text("".join(json.dumps(e) + "\n" for e in episodes))
    print(json.dumps(summarise(episodes), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
