"""SGLang's extra log-prob outputs: each position's top-k tokens and the log-probs of requested token ids.

`top_logprobs_num` k asks, at every scored position, for the k most likely tokens; `token_ids_logprob`
asks for the log-probs of the listed ids at every position. Both read the same distribution as the
token's own log-prob: log_softmax(logits / temperature). SGLang's layout: per position a list of
`[logprob, token_id, text]` entries (text None unless `return_text_in_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.engines.embedded.sampler import token_logprobs
from miles.engines.embedded.transfer import to_device
from miles.true_on_policy.scoring import scaled_log_softmax

MAX_TOP_LOGPROBS = 1024  # per scored position; SGLang sets no limit (docs/engines.md)

Entries = list[list]  # one position: [[logprob, token_id, None], ...]


@dataclass(slots=True)
class ExtrasRequest:
    """What a request asks beyond its tokens' own log-probs (only with `return_logprob`)."""

    top_k: int = 0
    token_ids: list[int] | None = None

    @property
    def wanted(self) -> bool:
        return self.top_k > 0 or bool(self.token_ids)


@dataclass(slots=True)
class Extras:
    """Per-position outputs for a run of positions; None for what was not asked."""

    top: list[Entries] | None = None
    token_ids: list[Entries] | None = None

    def extend(self, other: Extras) -> None:
        for name in ("top", "token_ids"):
            add = getattr(other, name)
            if add is not None:
                setattr(self, name, (getattr(self, name) or []) + add)


def check_request(top_k: int | None, token_ids: list[int] | None, vocab_size: int) -> ExtrasRequest:
    """Validate SGLang's `top_logprobs_num` / `token_ids_logprob` for one prompt."""
    k = int(top_k or 0)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs_num={k} must be in [0, {MAX_TOP_LOGPROBS}]: each scored position returns k entries"
        )
    ids = None
    if token_ids:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            raise ValueError(f"token_ids_logprob must be a list of token ids, got {token_ids!r:.80}")
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob has ids outside [0, {vocab_size}): {bad[:5]}")
        if len(token_ids) > vocab_size:
            raise ValueError(f"token_ids_logprob lists {len(token_ids)} ids; at most the vocabulary's {vocab_size}")
        ids = list(token_ids)
    return ExtrasRequest(min(k, vocab_size), ids)


def extras_of(log_probs: torch.Tensor, want: ExtrasRequest) -> Extras:
    """The extras of each row of fp32 log-probs [N, V] (rows = positions)."""
    out = Extras()
    if want.top_k > 0:
        values, ids = log_probs.topk(want.top_k, dim=-1)
        out.top = [
            [[v, t, None] for v, t in zip(vr, ir, strict=True)]
            for vr, ir in zip(values.tolist(), ids.tolist(), strict=True)
        ]
    if want.token_ids:
        index = torch.tensor(want.token_ids, device=log_probs.device)
        out.token_ids = [
            [[v, t, None] for v, t in zip(row, want.token_ids, strict=True)] for row in log_probs[:, index].tolist()
        ]
    return out


def input_extras(extras: Extras, start: int) -> Extras:
    """Extras of input positions from `start` on: position 0 predicts nothing, so it gets an empty list."""
    if start > 0:
        return extras
    return Extras(*(None if v is None else [[]] + v for v in (extras.top, extras.token_ids)))


def input_logprobs(req, full_logits: torch.Tensor) -> tuple[list[float | None], Extras | None]:
    """A request's log-prob of each prompt token given its prefix, from its logprob_start_len on (first token:
    None), and the extras it asked for at those positions (the first position has none: an empty list)."""
    ids = to_device(req.prompt_ids, full_logits.device)
    n, start = len(req.prompt_ids), req.logprob_start_len
    lps = token_logprobs(full_logits[: n - 1], ids[1:], req.params.temperature).tolist() if n > 1 else []
    extras = None
    if req.extras.wanted:  # row r of the logits predicts token r + 1
        rows = scaled_log_softmax(full_logits[max(start, 1) - 1 : n - 1], req.params.temperature)
        extras = input_extras(extras_of(rows, req.extras), start)
    return ([None] + lps)[start:], extras


def output_extras(sampled: list, logits: torch.Tensor, offset: int) -> dict[int, Extras]:
    """Top-k / token-id log-probs of the positions sampled now (row j of `logits` is `sampled[j]`'s), for the
    requests that asked (step index `offset + j` ->)."""
    out = {}
    for j, req in enumerate(sampled):
        if req.extras.wanted:
            rows = scaled_log_softmax(logits[j : j + 1], req.params.temperature)
            out[offset + j] = extras_of(rows, req.extras)
    return out
