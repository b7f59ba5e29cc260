"""SGLang's /generate request body, parsed into per-prompt calls of the engine's in-process API.

Mirrors `GenerateReqInput` in SGLang's io_struct.py: `text` or `input_ids`, each either one prompt
or a batch, with `sampling_params`, `rid`, `return_logprob`, `logprob_start_len` and
`top_logprobs_num` given once or per prompt, and `token_ids_logprob` (a list of ids: once, or one
list per prompt). Fields the embedded engine cannot honour are refused rather than silently dropped.
"""

from __future__ import annotations

import uuid
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")
# GenerateReqInput fields we cannot honour; refusing them beats silently returning less than asked.
UNSUPPORTED_GENERATE_FIELDS = (
    "stream",
    "return_routed_experts",
    "return_indexer_topk",
    "return_hidden_states",
    "lora_path",
    "image_data",
    "audio_data",
    "video_data",
    "input_embeds",
    "custom_logit_processor",
)
PER_ITEM_FIELDS = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")


def parse_generate_body(body: dict) -> tuple[list[dict], bool]:
    """Split an SGLang /generate body into per-prompt engine kwargs; returns (calls, is_batch)."""
    for name in UNSUPPORTED_GENERATE_FIELDS:
        if body.get(name):
            raise ValueError(
                f"/generate field {name}={body[name]!r} is not supported by the embedded engine; "
                "drop it (see docs/engines.md) or run the SGLang backend"
            )
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("/generate needs exactly one of 'text' or 'input_ids'")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError(f"/generate input_ids must be a non-empty list of ints, got {input_ids!r:.80}")
        is_batch = isinstance(input_ids[0], list)
        prompts = [("input_ids", p) for p in (input_ids if is_batch else [input_ids])]
    else:
        is_batch = isinstance(text, list)
        prompts = [("text", p) for p in (text if is_batch else [text])]
    calls = []
    for i, (key, prompt) in enumerate(prompts):
        item = {name: _item_field(body, name, i, len(prompts), is_batch) for name in PER_ITEM_FIELDS}
        call = {
            key: prompt,
            "sampling_params": dict(item["sampling_params"] or {}),
            "rid": item["rid"] or uuid.uuid4().hex,
            "return_logprob": bool(item["return_logprob"]),
            "logprob_start_len": -1 if item["logprob_start_len"] is None else int(item["logprob_start_len"]),
        }
        # the extra log-prob outputs are passed only when asked for
        if item["top_logprobs_num"]:
            call["top_logprobs_num"] = int(item["top_logprobs_num"])
        token_ids = _token_ids(body.get("token_ids_logprob"), i, len(prompts), is_batch)
        if token_ids:
            call["token_ids_logprob"] = token_ids
        calls.append(call)
    return calls, is_batch


def _token_ids(value: Any, index: int, batch_size: int, is_batch: bool) -> list[int] | None:
    """`token_ids_logprob`: one list of ids for every prompt, or (a batch) one list per prompt."""
    if not value:
        return None
    if not isinstance(value, list):
        raise ValueError(f"/generate token_ids_logprob must be a list of token ids, got {value!r:.80}")
    if not isinstance(value[0], list):
        return value
    if not is_batch or len(value) != batch_size:
        raise ValueError(f"/generate token_ids_logprob has {len(value)} lists for {batch_size} prompt(s)")
    return value[index] or None


def _item_field(body: dict, name: str, index: int, batch_size: int, is_batch: bool) -> Any:
    value = body.get(name)
    if not isinstance(value, list):
        if name == "rid" and value is not None and is_batch and batch_size > 1:
            raise ValueError(f"/generate with a batch of {batch_size} prompts needs rid as a list of {batch_size}")
        return value
    if not is_batch:
        raise ValueError(f"/generate field {name} is a list but the prompt is a single one")
    if len(value) != batch_size:
        raise ValueError(f"/generate field {name} has {len(value)} entries for {batch_size} prompts")
    return value[index]
