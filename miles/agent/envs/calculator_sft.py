"""Supervised warm-up data for the calculator environment: worked episodes as prompt/response rows.

SmolLM2-135M-Instruct writes no valid tool call at step 0 (bench/calculator_probe.py), so RL has no
tool use to reinforce. These rows show it the two assistant turns of a solved episode, rendered exactly
as the session server renders them for the model family (`--tito-model`):

1. the system prompt with the tool, the task -> the calculator call;
2. the same, the call and the tool's result -> "Answer: <number>".

Each row's prompt is the rendered conversation text (with the generation prompt), its response the
assistant's text without the end-of-turn token, which the SFT data path appends as EOS
(`--loss-type sft_loss`, prompt/response rows: docs/lora_sft.md).

    python -m miles.agent.envs.calculator_sft --model-path smollm2: --out calculator_sft.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from miles.agent.envs.calculator import TOOL, calculate, first_messages
from miles.agent.tito import TitoTokenizer

_TASK = re.compile(r"What is (.+)\?$")


def _call(expression: str) -> dict:
    return {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": expression}},
    }


def _turn(tito: TitoTokenizer, before: list[dict], reply: dict) -> dict[str, str]:
    """The prompt (`before` rendered with the generation prompt) and the reply's text up to its end of turn."""
    prompt = tito.render(before, [TOOL], add_generation_prompt=True)
    whole = tito.render([*before, reply], [TOOL], add_generation_prompt=False)
    if not whole.startswith(prompt):
        raise ValueError(f"family {tito.family.name!r} does not render the reply after the prompt it renders alone")
    response = whole[len(prompt) :]
    end = response.rfind(tito.end_of_turn)
    if end < 0:
        raise ValueError(f"family {tito.family.name!r}: no end of turn {tito.end_of_turn!r} after the reply")
    return {"prompt": prompt, "response": response[:end]}


def sft_rows(tasks: Iterable[dict], tito: TitoTokenizer) -> Iterator[dict[str, str]]:
    """Two rows per task row (`messages` with one user turn "What is EXPR?"): the call, then the answer."""
    for task in tasks:
        messages = first_messages(task["messages"])
        match = _TASK.match(messages[-1]["content"])
        if match is None:
            raise ValueError(f"calculator task {messages[-1]['content']!r} is not 'What is <expression>?'")
        expression = match.group(1)
        call = {"role": "assistant", "content": "", "tool_calls": [_call(expression)]}
        yield _turn(tito, messages, call)
        result = {"role": "tool", "tool_call_id": "call_0", "content": calculate(expression)}
        yield _turn(tito, [*messages, call, result], {"role": "assistant", "content": f"Answer: {task['label']}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the calculator environment's supervised warm-up rows.")
    parser.add_argument(
        "--model-path",
        required=True,
        help="the model whose tokenizer renders the rows: a directory or a spec (smollm2:)",
    )
    parser.add_argument("--tasks", default="launch/data/calculator_train.jsonl")
    parser.add_argument("--tito-model", default="chatml", help="the model family the session server will use")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from miles.agent.families import resolve_family
    from miles.models.resolve import resolve_spec

    path = resolve_spec(args.model_path) or args.model_path
    tito = TitoTokenizer(resolve_family(args.tito_model), AutoTokenizer.from_pretrained(path))
    tasks = [json.loads(line) for line in Path(args.tasks).read_text().splitlines() if line.strip()]
    rows = list(sft_rows(tasks, tito))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows ({len(tasks)} tasks x 2 turns) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
