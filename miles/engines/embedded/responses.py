"""The embedded engine's answers in SGLang's /generate response shape: `{text, output_ids, meta_info}`.

`meta_info` carries the finish reason, token counts, the weight version of every output token, the
log-probs asked for (`[logprob, token_id, None]` entries; the HTTP front fills in the texts) and their
top-k / token-id extras, and the routed experts of MoE models (base64, miles/utils/routing.py).
"""

from __future__ import annotations

from miles.engines.embedded.logprob_extras import Extras, ExtrasRequest
from miles.engines.embedded.request import Request
from miles.utils.routing import encode_sglang


def generate_response(req: Request, tokenizer, weight_version: int) -> dict:
    """A finished request's response; a matched stop token or string is trimmed unless `no_stop_trim`."""
    p, reason = req.params, req.finish_reason
    ids = req.output_ids
    trim_token = reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not p.no_stop_trim
    text = tokenizer.decode(ids[:-1] if trim_token else ids, skip_special_tokens=p.skip_special_tokens)
    matched = reason.get("matched")
    if isinstance(matched, str) and not p.no_stop_trim and matched in text:
        text = text[: text.index(matched)]
    meta = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(ids),
        "cached_tokens": req.cached_tokens or 0,
        "weight_version": str(weight_version),
        "output_token_weight_versions": list(req.output_versions),
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, ids, strict=True)]
        put_extras(meta, "output", req.extras, req.output_extras)
        if req.logprob_start_len >= 0:
            tokens = req.prompt_ids[req.logprob_start_len :]
            meta["input_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(req.input_logprobs or [], tokens, strict=False)
            ]
            put_extras(meta, "input", req.extras, req.input_extras or Extras())
    if req.routed is not None:  # the last token was never fed: seq_len - 1 rows
        meta["routed_experts"] = encode_sglang(req.routed[req.routed_start : req.seq_len - 1])
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def scoring_response(
    rid: str,
    prompt: list[int],
    start: int,
    logprobs: list[float | None],
    asked: ExtrasRequest,
    extras: Extras,
    weight_version: int,
) -> dict:
    """A prefill-only scoring request's response: the input log-probs of `prompt` from `start` on, no output."""
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "cached_tokens": 0,
        "weight_version": str(weight_version),
        "output_token_weight_versions": [],
        "output_token_logprobs": [],
        "input_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, prompt[start:], strict=True)],
    }
    put_extras(meta, "output", asked, Extras())
    put_extras(meta, "input", asked, extras)
    return {"text": "", "output_ids": [], "meta_info": meta}


def put_extras(meta: dict, side: str, asked: ExtrasRequest, got: Extras) -> None:
    """SGLang's `{side}_top_logprobs` / `{side}_token_ids_logprobs` keys, for what was asked."""
    if asked.top_k > 0:
        meta[f"{side}_top_logprobs"] = got.top or []
    if asked.token_ids:
        meta[f"{side}_token_ids_logprobs"] = got.token_ids or []
