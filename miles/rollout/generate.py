"""Single-turn generation of one Sample through the router, token-in token-out."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from miles.rollout.sample import Sample, SampleStatus
from miles.utils.routing import RoutingShape

STUDENT_TOP_KEY = "opd_student_top_logprobs"  # Sample.metadata: per response token, [[log-prob, id], ...]


@dataclass(slots=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 256
    max_context_len: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = False
    top_logprobs_num: int = 0  # top-K log-probs recorded with every sampled token (top-K OPD); 0: none
    routing: RoutingShape | None = None  # R3: ask for the routed experts of every token (the model's MoE shape)

    def to_payload(self, prompt_len: int, *, seed: int | None = None) -> dict[str, Any]:
        max_new = self.max_new_tokens
        if self.max_context_len is not None:
            max_new = max(0, min(max_new, self.max_context_len - prompt_len))
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": max_new,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if seed is not None:
            params["sampling_seed"] = seed
        return params


def prompt_token_ids(sample: Sample, tokenizer) -> list[int]:
    if sample.tokens:
        return list(sample.tokens[: sample.prompt_length])
    if isinstance(sample.prompt, list):
        # return_dict=False: transformers 5 returns a BatchEncoding by default, whose list() is its keys
        ids = tokenizer.apply_chat_template(
            sample.prompt, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        return list(ids)
    return list(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])


def _version(reported: Any) -> int:
    """A reply's weight version; SGLang reports "default" until its first weight update: its startup weights,
    which miles numbers 0."""
    try:
        return int(reported or 0)
    except ValueError:
        return 0


def parse_output(out: dict[str, Any]) -> tuple[list[int], list[float], list[int], str]:
    """Token ids, log-probs, per-token weight versions and finish type of one SGLang-shaped reply."""
    meta = out["meta_info"]
    logprobs = meta.get("output_token_logprobs") or []
    output_ids = out.get("output_ids")
    if output_ids is None:  # SGLang returns ids through the logprob triples when output_ids is absent
        output_ids = [int(t[1]) for t in logprobs]
    versions = meta.get("output_token_weight_versions")
    if versions is None:
        versions = [_version(meta.get("weight_version"))] * len(output_ids)
    ids = [int(t) for t in output_ids]
    lps = [float(t[0]) for t in logprobs] if logprobs else [0.0] * len(ids)
    return ids, lps, [int(v) for v in versions], (meta.get("finish_reason") or {}).get("type", "stop")


def _record_top_logprobs(sample: Sample, out: dict[str, Any], *, extend: bool) -> None:
    """Keep the engine's per-token top-K log-probs (asked for by top-K OPD) as [[log-prob, id], ...] lists."""
    tops = out["meta_info"].get("output_top_logprobs")
    if tops is None:
        return
    new = [[[float(e[0]), int(e[1])] for e in pos or []] for pos in tops]
    old = (sample.metadata.get(STUDENT_TOP_KEY) or []) if extend else []
    sample.metadata[STUDENT_TOP_KEY] = old + new


def request_extras(sampling: SamplingDefaults) -> dict[str, Any]:
    """/generate body fields beyond the prompt and sampling parameters that the run asks every request for."""
    extras: dict[str, Any] = {}
    if sampling.top_logprobs_num:
        extras["top_logprobs_num"] = sampling.top_logprobs_num
    if sampling.routing is not None:
        extras["return_routed_experts"] = True
    return extras


def record_routing(sample: Sample, out: dict[str, Any], routing: RoutingShape | None) -> None:
    """R3: the reply's routed experts (asked from position 0, so they cover every token of `sample.tokens`
    but the last, a resumed request's earlier tokens included) as the sample's narrow-typed array."""
    if routing is None:
        return
    encoded = out["meta_info"].get("routed_experts")
    if encoded is None:
        raise RuntimeError(
            "--use-rollout-routing-replay: the engine's reply has no meta_info.routed_experts; an SGLang engine "
            "needs --enable-return-routed-experts (miles sets it for the engines it launches)"
        )
    routed = routing.decode(encoded)
    if len(routed) != len(sample.tokens) - 1:
        raise RuntimeError(
            f"routed_experts has {len(routed)} rows for a {len(sample.tokens)}-token sequence (expected "
            f"{len(sample.tokens) - 1}); the engine and the trainer disagree on the model"
        )
    sample.rollout_routed_experts = routed


def apply_generate_output(
    sample: Sample, prompt_ids: list[int], out: dict[str, Any], routing: RoutingShape | None = None
) -> Sample:
    """Fill a sample from one SGLang-shaped /generate response (the engine's exact token ids)."""
    ids, logprobs, versions, finish = parse_output(out)
    _record_top_logprobs(sample, out, extend=False)
    sample.tokens = list(prompt_ids) + ids
    sample.response = out.get("text", "")
    sample.response_length = len(ids)
    sample.rollout_log_probs = logprobs
    sample.weight_versions = versions
    sample.loss_mask = [1] * len(ids)
    sample.status_from_finish_reason(finish)
    record_routing(sample, out, routing)
    return sample


def extend_with_output(sample: Sample, out: dict[str, Any], routing: RoutingShape | None = None) -> Sample:
    """Append a resumed request's output to a partial response: earlier tokens keep their log-probs
    and weight versions, so `weight_versions` records which version produced each token."""
    ids, logprobs, versions, finish = parse_output(out)
    _record_top_logprobs(sample, out, extend=True)
    sample.tokens = list(sample.tokens) + ids
    sample.response += out.get("text", "")
    sample.response_length += len(ids)
    sample.rollout_log_probs = list(sample.rollout_log_probs or []) + logprobs
    sample.weight_versions = list(sample.weight_versions) + versions
    sample.loss_mask = list(sample.loss_mask or []) + [1] * len(ids)
    sample.status_from_finish_reason(finish)
    record_routing(sample, out, routing)
    return sample


def is_partial(sample: Sample) -> bool:
    """An aborted sample that kept its tokens (--partial-rollout): generation resumes after them."""
    return sample.status == SampleStatus.ABORTED and sample.response_length > 0


def is_fresh(sample: Sample) -> bool:
    """Not generated yet: no tokens past the prompt, nothing to resume."""
    return sample.status == SampleStatus.PENDING and sample.response_length == 0


async def generate_group(
    router, samples: list[Sample], tokenizer, sampling: SamplingDefaults, *, seeds: list[int | None]
) -> list[Sample]:
    """Fresh samples of one group in one batched /generate call (SGLang's list form: one prompt,
    sampling-params dict and rid per item), filled as `generate_sample` fills each.

    One HTTP round trip for the group instead of one per sample: the per-request cost (HTTP, JSON
    framing, routing) is paid once, and the engine receives the group's prompts together.
    """
    prompt_ids = [prompt_token_ids(s, tokenizer) for s in samples]
    rids = [uuid.uuid4().hex for _ in samples]
    params = []
    for sample, ids, rid, seed in zip(samples, prompt_ids, rids, seeds, strict=True):
        sample.metadata["rid"] = rid
        params.append({**sampling.to_payload(len(ids), seed=seed), **(sample.metadata.get("sampling_params") or {})})
    payload = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True, "rid": rids}
    payload.update(request_extras(sampling))
    outs = await router.generate(payload)
    if not isinstance(outs, list) or len(outs) != len(samples):
        raise RuntimeError(
            f"a batched /generate of {len(samples)} prompts returned {type(outs).__name__} "
            f"of {len(outs) if isinstance(outs, list) else 1}"
        )
    return [
        apply_generate_output(s, ids, out, sampling.routing)
        for s, ids, out in zip(samples, prompt_ids, outs, strict=True)
    ]


async def generate_sample(
    router, sample: Sample, tokenizer, sampling: SamplingDefaults, *, seed: int | None = None
) -> Sample:
    """One trajectory: tokens in, tokens + log-probs + per-token weight versions out.

    A partial sample (see `is_partial`) sends prompt + partial response and continues it, with
    `max_new_tokens` reduced by the tokens it already has (Miles' partial-rollout resume).
    """
    if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
        return sample
    resumed = is_partial(sample)
    prompt_ids = prompt_token_ids(sample, tokenizer)
    rid = uuid.uuid4().hex
    sample.metadata["rid"] = rid
    params = {
        **sampling.to_payload(len(prompt_ids), seed=seed),
        **(sample.metadata.get("sampling_params") or {}),
    }  # per-prompt overrides
    if resumed:
        params["max_new_tokens"] = params["max_new_tokens"] - sample.response_length
        if params["max_new_tokens"] <= 0:  # the budget ran out as it was aborted
            sample.status = SampleStatus.TRUNCATED
            return sample
    payload = {
        "input_ids": list(sample.tokens) if resumed else prompt_ids,
        "sampling_params": params,
        "return_logprob": True,
        "rid": rid,
        **request_extras(sampling),
    }
    keyed = {"routing_key": sample.routing_key} if sample.routing_key else {}  # session mode: one engine per key
    out = await router.generate(payload, **keyed)
    if resumed:
        return extend_with_output(sample, out, sampling.routing)
    return apply_generate_output(sample, prompt_ids, out, sampling.routing)
