"""Model families of the session server: one chat template and one tool-call format per family.

A family is a set of checkpoints that share a chat template, an end-of-turn token and a tool-call
format. The session server never guesses a family from a checkpoint: the run names it
(`--tito-model`), and the name resolves to a registration here, checked by
`miles.agent.tito.check_append_only` (the CPU check: rendered token sequences stay append-only
from turn to turn). `default` uses the checkpoint's own template unverified, with a warning.

A user registers a family without editing miles by pointing `--tito-model` at a `ModelFamily`
object (`pkg.module:MY_FAMILY`); the server runs the CPU check on it at start-up.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.utils.misc import PluginError, load_function

logger = logging.getLogger(__name__)

# ChatML with Hermes-style tool calls (the Qwen2.5 layout): tools listed in the system turn, a call
# written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a tool result as a user turn
# wrapped in <tool_response>. Every turn ends with <|im_end|> and a newline.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

ToolParser = Callable[[str], tuple[str, list[dict[str, Any]]]]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_hermes_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the calls, OpenAI tool calls) from `<tool_call>{"name", "arguments"}</tool_call>` blocks.

    A block that is not a JSON object with a string "name" stays in the content: the model wrote
    text, not a call. Arguments are re-serialised with json.dumps (OpenAI carries them as a string).
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES_CALL.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def _hermes_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    arguments = json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes_tool_calls}


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One registration: how a family's messages become tokens and its outputs become messages.

    chat_template: Jinja source (None: the checkpoint's own). end_of_turn: the token that ends every
    turn, a stop token of each request (None: the tokenizer's eos). checked_on: the checkpoints the
    CPU check passed on when the family was registered (empty: unverified, the server warns).
    """

    name: str
    chat_template: str | None = None
    end_of_turn: str | None = None
    tool_call_parser: str = "hermes"
    checked_on: tuple[str, ...] = ()

    def parse_tool_calls(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return TOOL_PARSERS[self.tool_call_parser](text)


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family under its name (replacing one of the same name); returns it."""
    if family.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"family {family.name!r}: tool_call_parser={family.tool_call_parser!r} is not one of "
            f"{sorted(TOOL_PARSERS)}"
        )
    FAMILIES[family.name] = family
    return family


register_family(
    ModelFamily(
        "chatml",
        chat_template=CHATML_TOOLS_TEMPLATE,
        end_of_turn="<|im_end|>",
        checked_on=("miles tiny-model (qwen2, llama, qwen3)", "SmolLM2-135M-Instruct"),
    )
)
register_family(ModelFamily("default"))


def resolve_family(spec: str) -> ModelFamily:
    """A registered family by name, or a `ModelFamily` object by import path; ValueError names the choices."""
    if spec in FAMILIES:
        return FAMILIES[spec]
    if "." in spec or ":" in spec:
        try:
            obj = load_function(spec)
        except PluginError as e:
            raise ValueError(f"--tito-model {spec!r} does not load: {e}") from None
        if isinstance(obj, ModelFamily):
            return obj
        raise ValueError(f"--tito-model {spec!r} is a {type(obj).__name__}, not a miles.agent.families.ModelFamily")
    raise ValueError(
        f"--tito-model {spec!r} is not a registered family ({', '.join(sorted(FAMILIES))}) "
        "nor an import path of a ModelFamily"
    )
