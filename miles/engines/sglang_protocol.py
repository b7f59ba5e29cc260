"""SGLang's request bodies: /generate parsed into per-prompt calls of the engine's in-process API, and
the fields of every other request class the embedded front serves.

`/generate` mirrors `GenerateReqInput` in SGLang's io_struct.py: `text` or `input_ids`, each either
one prompt or a batch, with `sampling_params`, `rid`, `return_logprob`, `logprob_start_len` and
`top_logprobs_num` given once or per prompt, and `token_ids_logprob` (a list of ids: once, or one
list per prompt). Fields the embedded engine cannot honour are refused rather than silently dropped.

`REQUEST_FIELDS`: for each control and weight endpoint, the fields of SGLang's request class (as of
`SGLANG_VERSION_CHECKED`; tests/contract compares the table with SGLang's own classes). The
embedded front refuses any other field with a 400: SGLang would drop it silently, and a field it
drops is one whose sender believed it did something.
"""

from __future__ import annotations

import uuid
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")
# GenerateReqInput fields we cannot honour; refusing them beats silently returning less than asked.
UNSUPPORTED_GENERATE_FIELDS = (
    "stream",
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

SGLANG_VERSION_CHECKED = "0.5.23"
_BASE_REQ = ("rid", "http_worker_ipc")  # every io_struct request class has these
# endpoint -> fields of SGLang's request class for it (io_struct.py at SGLANG_VERSION_CHECKED)
REQUEST_FIELDS: dict[str, frozenset[str]] = {
    name: frozenset((*_BASE_REQ, *fields))
    for name, fields in {
        "abort_request": ("abort_all", "finished_reason", "abort_message", "weight_versions"),  # AbortReq
        "pause_generation": ("mode",),  # PauseGenerationReqInput
        "continue_generation": ("torch_empty_cache",),  # ContinueGenerationReqInput
        "release_memory_occupation": ("tags",),  # ReleaseMemoryOccupationReqInput
        "resume_memory_occupation": ("tags",),  # ResumeMemoryOccupationReqInput
        "update_weight_version": ("new_version", "abort_all_requests"),  # UpdateWeightVersionReqInput
        "init_weights_update_group": (  # InitWeightsUpdateGroupReqInput
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
        ),
        "destroy_weights_update_group": ("group_name",),  # DestroyWeightsUpdateGroupReqInput
        "update_weights_from_distributed": (  # UpdateWeightsFromDistributedReqInput
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "load_format",
            "selector",
            "torch_empty_cache",
        ),
        "update_weights_from_tensor": (  # UpdateWeightsFromTensorReqInput
            "serialized_named_tensors",
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "selector",
            "torch_empty_cache",
        ),
        "update_weights_from_disk": (  # UpdateWeightFromDiskReqInput
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
            "token_step",
            "flush_cache",
            "manifest",
        ),
    }.items()
}
# fields SGLang declares as strings that a JSON number would fail to decode into (SGLang answers 400)
STRING_FIELDS = ("weight_version", "new_version", "group_name", "master_address", "model_path")


def check_request_fields(endpoint: str, body: dict) -> None:
    """Refuse (ValueError: HTTP 400) a body field SGLang's request class for `endpoint` does not have, and a
    number where SGLang's class takes a string; endpoints SGLang does not have are not checked."""
    known = REQUEST_FIELDS.get(endpoint)
    if known is None:
        return
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(
            f"/{endpoint} fields {unknown} are not fields of SGLang's request class (SGLang {SGLANG_VERSION_CHECKED} "
            f"would drop them silently); known: {sorted(known - set(_BASE_REQ))}"
        )
    wrong = [
        name for name in STRING_FIELDS if name in body and body[name] is not None and not isinstance(body[name], str)
    ]
    if wrong:
        raise ValueError(f'/{endpoint} fields {wrong} must be strings, as SGLang declares them (send e.g. "3")')


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
        if body.get("return_routed_experts"):  # one value for the whole body, as in SGLang
            call["return_routed_experts"] = True
            call["routed_experts_start_len"] = int(body.get("routed_experts_start_len") or 0)
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
