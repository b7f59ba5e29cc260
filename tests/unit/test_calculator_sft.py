"""The calculator's supervised warm-up rows: what the session server would show and parse, turn by turn."""

from __future__ import annotations

import json

from miles.agent.envs.calculator import TOOL, first_messages
from miles.agent.envs.calculator_sft import main, sft_rows
from miles.agent.families import FAMILIES
from miles.agent.tito import TitoTokenizer
from miles.models.tiny import build_tokenizer

TITO = TitoTokenizer(FAMILIES["chatml"], build_tokenizer())
TASK = {"messages": [{"role": "user", "content": "What is (3 + 4) * 2?"}], "label": "14"}


def _reply(response: str) -> dict:
    return TITO.parse_reply(TITO.encode(response) + [TITO.end_of_turn_id])


def test_the_first_row_is_the_servers_first_prompt_and_a_call_it_parses():
    call_row, _ = sft_rows([TASK], TITO)
    assert TITO.encode(call_row["prompt"]) == TITO.prompt_ids(first_messages(TASK["messages"]), [TOOL])
    reply = _reply(call_row["response"])
    assert [c["function"]["name"] for c in reply["tool_calls"]] == ["calculator"]
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"expression": "(3 + 4) * 2"}


def test_the_second_row_sees_the_tools_result_and_answers():
    _, answer_row = sft_rows([TASK], TITO)
    assert "<tool_response>\n14\n</tool_response>" in answer_row["prompt"]
    assert answer_row["prompt"].startswith(
        TITO.render(first_messages(TASK["messages"]), [TOOL], add_generation_prompt=False)
    )
    assert _reply(answer_row["response"]) == {"role": "assistant", "content": "Answer: 14"}


def test_the_command_writes_two_rows_a_task(tmp_path):
    from miles.models.tiny import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n" + json.dumps({**TASK, "label": "14"}) + "\n")
    out = tmp_path / "sft.jsonl"
    assert main(["--model-path", model, "--tasks", str(tasks), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(set(r) == {"prompt", "response"} for r in rows)
