"""The host's bookkeeping of a step (`apply_step`: each request's new token, log-prob, weight version and
whether it finished), and what stays true of one running batch across its decode steps (`DecodePlan`), so
that the usual step's share is a few C-level loops rather than a Python loop over the batch.

While the same requests run in the same order (the usual case: nobody finished, nobody joined), each step
appends one token, one log-prob and one weight version to every request. A `DecodePlan` is made when the
batch changes and then counts the steps it has seen (`applied`); from what it read once (each request's
lengths, limits and stop ids) it answers, without visiting the requests again:

- `lengths_reached`: whether any request may have reached `max_new_tokens` or the context limit;
- `may_stop`: whether a step's tokens hold any request's stop id (one set test over the step's tokens);
- `may_look_ahead`: whether the next step can be launched ahead (no private generator, no extras or
  routing to collect, room for one more token in every request, and one request still going on);
- `positions`: where the next step's tokens go (each request's sequence length).

A batch is `plain` when nothing else needs a per-token look: no stop strings, no top-k / token-id log-probs,
no routing record, no prefill-only scoring request. `apply_step` appends a plain batch's step with
`append_step` and looks at its requests only on the steps where the plan says one may finish; any other
step goes request by request (input log-probs, routing rows, extras, `check_stop_strings`).
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from miles.engines.embedded.request import Request, StepResult

Finished = list[tuple[int, dict]]  # (step index, finish reason) of the requests a step finished


@dataclass(slots=True)
class DecodePlan:
    reqs: list[Request]
    plain: bool
    look_ahead_ok: bool  # the step-independent part of may_look_ahead
    stop_ids: frozenset[int]  # every request's stop ids together
    headroom: int  # tokens every request can append before one reaches a length limit
    longest: int  # tokens the request furthest from its max_new_tokens can still append
    seq_lens: list[int]  # each request's sequence length when the plan was made
    longest_seq: int  # the longest of them
    params: list  # each request's SamplingParams (the sampler's batch is cached on this list)
    max_seq_len: int  # the engine's context limit
    outputs: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    applied: int = 0  # steps appended since the plan was made

    @classmethod
    def of(cls, reqs: list[Request], max_seq_len: int) -> DecodePlan:
        seq_lens = [r.seq_len for r in reqs]
        budget = [r.params.max_new_tokens - len(r.output_ids) for r in reqs]
        # nothing to collect per token (top-k / token-id log-probs, routing) and nothing only scored
        simple = all(not r.extras.wanted and r.routed is None and r.params.max_new_tokens for r in reqs)
        return cls(
            reqs=list(reqs),
            plain=simple and all(not r.params.stop for r in reqs),
            look_ahead_ok=simple and all(r.generator is None for r in reqs),
            stop_ids=frozenset().union(*(r.stop_ids for r in reqs)),
            headroom=min((min(b, max_seq_len - s) for b, s in zip(budget, seq_lens, strict=True)), default=0),
            longest=max(budget, default=0),
            seq_lens=seq_lens,
            longest_seq=max(seq_lens, default=0),
            params=[r.params for r in reqs],
            max_seq_len=max_seq_len,
            outputs=[r.output_ids for r in reqs],
            logprobs=[r.output_logprobs for r in reqs],
            versions=[r.output_versions for r in reqs],
        )

    def covers(self, reqs: list[Request]) -> bool:
        """True when `reqs` are this plan's requests in its order (compared by identity, in C)."""
        return len(reqs) == len(self.reqs) and all(map(operator.is_, reqs, self.reqs))

    def positions(self) -> list[int]:
        """Each request's sequence length now: the position the next step's token is written at."""
        k = self.applied
        return [s + k for s in self.seq_lens] if k else list(self.seq_lens)

    def may_look_ahead(self) -> bool:
        """See the module doc: the next step can be launched ahead of this step's bookkeeping."""
        k = self.applied
        return (
            self.look_ahead_ok
            and bool(self.reqs)
            and self.longest_seq + k + 1 < self.max_seq_len
            and k + 1 < self.longest
        )

    def append_step(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        """Append one step's token, log-prob and weight version to every request (C-level loops)."""
        _consume(map(list.append, self.outputs, tokens))
        _consume(map(list.append, self.logprobs, logprobs))
        _consume(map(list.append, self.versions, itertools.repeat(version)))
        self.applied += 1

    def lengths_reached(self) -> bool:
        """After `append_step`: whether a request may have reached a length limit."""
        return self.applied >= self.headroom

    def may_stop(self, tokens: list[int]) -> bool:
        return bool(self.stop_ids) and not self.stop_ids.isdisjoint(tokens)


def apply_step(
    running: list[Request],
    result: StepResult,
    plan: DecodePlan,
    check_stop_strings: Callable[[Request], dict | None],
    max_seq_len: int,
) -> Finished:
    """Give each of `running` (step order) its part of the step's `result`; return the ones it finished."""
    if plan.plain and not (result.input_logprobs or result.output_extras or result.routed):
        if len(result.tokens) != len(running):
            raise RuntimeError(f"a step returned {len(result.tokens)} tokens for {len(running)} requests")
        plan.append_step(result.tokens, result.logprobs, result.weight_version)
        if plan.lengths_reached() or plan.may_stop(result.tokens):
            return finished_plain(running, max_seq_len)
        return []
    finished: Finished = []
    input_lps, version = result.input_logprobs, result.weight_version
    extras, routed = result.output_extras, result.routed
    for i, (req, token, logprob) in enumerate(zip(running, result.tokens, result.logprobs, strict=True)):
        if input_lps and i in input_lps:
            req.input_logprobs, req.input_extras = input_lps[i]
        if routed and i in routed:
            start, rows = routed[i]
            req.routed[start : start + len(rows)] = rows
        if req.params.max_new_tokens == 0:  # prefill-only scoring: nothing is sampled
            finished.append((i, {"type": "length", "length": 0}))
            continue
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        req.output_versions.append(version)
        if extras and i in extras:
            req.output_extras.extend(extras[i])
        if (reason := _finish_reason(req, max_seq_len, check_stop_strings)) is not None:
            finished.append((i, reason))
    plan.applied += 1
    return finished


def finished_plain(running: list[Request], max_seq_len: int) -> Finished:
    """The requests of a plain batch that their last token finished (a stop id, or a length limit)."""
    return [(i, reason) for i, req in enumerate(running) if (reason := _finish_reason(req, max_seq_len)) is not None]


def _finish_reason(
    req: Request, max_seq_len: int, check_stop_strings: Callable[[Request], dict | None] | None = None
) -> dict | None:
    """Why the token just appended finishes `req` (a stop id, a stop string, a length limit), or None."""
    out = req.output_ids
    if out[-1] in req.stop_ids:
        return {"type": "stop", "matched": out[-1]}
    if req.params.stop and check_stop_strings is not None and (reason := check_stop_strings(req)) is not None:
        return reason
    if len(out) >= req.params.max_new_tokens or len(req.prompt_ids) + len(out) >= max_seq_len:
        return {"type": "length", "length": len(out)}
    return None


def _consume(iterator) -> None:
    collections.deque(iterator, maxlen=0)
