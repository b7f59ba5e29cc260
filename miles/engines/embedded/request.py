"""The scheduler's records: a request as it waits and runs (its tokens, log-probs, KV epoch, prefix pages),
what one step hands back to the event loop, a decode step launched ahead, the batching counts, and the
per-step host timings a bench can ask for (and their summary over the decode steps)."""

from __future__ import annotations

import asyncio
import operator
import statistics
from dataclasses import dataclass, field

import numpy as np
import torch

from miles.engines.embedded.logprob_extras import Extras, ExtrasRequest
from miles.engines.embedded.prefix_cache import Lease
from miles.engines.embedded.sampler import SamplingParams
from miles.engines.embedded.transfer import to_device


@dataclass(slots=True)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    future: asyncio.Future
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict | None = None
    kv_epoch: int = -1  # epoch of the KV in this request's slot; -1 = none
    abort_requested: bool = False
    prefill_count: int = 0
    stop_ids: frozenset[int] = frozenset()  # token ids that finish it (its stop_token_ids, eos unless ignored)
    extras: ExtrasRequest = field(default_factory=ExtrasRequest)  # top-k / token-id log-probs asked for
    output_extras: Extras = field(default_factory=Extras)
    input_extras: Extras | None = None
    routed: np.ndarray | None = None  # return_routed_experts: [capacity, moe_layers, k], row p = token p's forward
    routed_start: int = 0  # routed_experts_start_len: the first row returned
    lease: Lease | None = None  # the prefix cache pages this request holds while it runs
    cached_tokens: int | None = None  # prompt tokens its first prefill took from the prefix cache

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None


@dataclass(slots=True)
class Lookahead:
    """A decode step launched ahead for `reqs` (step order); its results stay on the device."""

    reqs: list[Request]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    kv_epoch: int
    weight_version: int

    def rows(self, reqs: list[Request]) -> range | list[int] | None:
        """The row of each of `reqs` in this step; None when one of them was not in it. The usual decode step
        (the same requests, in order: nobody left) is found by identity in C, without a per-step index."""
        n = len(reqs)
        if n <= len(self.reqs) and all(map(operator.is_, reqs, self.reqs)):
            return range(n)
        index = {id(r): i for i, r in enumerate(self.reqs)}
        rows = [index.get(id(r)) for r in reqs]
        return None if None in rows else rows

    def take(self, rows: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logprobs) of those rows, on the device (a view when they lead in order)."""
        if isinstance(rows, range) or rows == list(range(len(rows))):
            return self.tokens[: len(rows)], self.logprobs[: len(rows)]
        index = to_device(rows, self.tokens.device)
        return self.tokens[index], self.logprobs[index]


@dataclass(slots=True)
class StepResult:
    tokens: list[int]
    logprobs: list[float]
    input_logprobs: dict[int, tuple[list[float | None], Extras | None]]  # step index -> input log-probs, extras
    weight_version: int
    lookahead: Lookahead | None = None
    output_extras: dict[int, Extras] = field(default_factory=dict)  # step index -> this token's extras
    routed: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)  # step index -> (first position, rows)
    from_lookahead: bool = False  # the decode rows' tokens came from a step launched ahead
    wait_s: float = 0.0  # host seconds spent waiting for the device's results


@dataclass(slots=True)
class StepTime:
    """One scheduler step as the host saw it (recorded while `Scheduler.timeline` is a list): when the
    loop began it and finished its bookkeeping (perf_counter seconds), how long it waited for the
    device, its decode and prefill rows, and whether its decode tokens came from a lookahead."""

    start: float
    end: float
    wait_s: float
    decode: int
    prefill: int
    from_lookahead: bool


@dataclass
class StepCounts:
    """How the scheduler batched its work since the last `Scheduler.take_counts()`."""

    steps: int = 0
    prefill_steps: int = 0  # steps that admitted new requests
    prefilled: int = 0  # requests admitted
    step_s: float = 0.0  # host seconds inside the steps

    def summary(self) -> str:
        return (
            f"{self.prefilled} requests in {self.steps} steps ({self.prefill_steps} with prefill, "
            f"{self.step_s:.3f} s in steps)"
        )


def decode_step_summary(steps: list[StepTime], batch: int) -> dict | None:
    """How the host spent the decode steps of a full `batch` (no prefill in them), from a scheduler
    timeline: the median wall time from one such step's start to the next's (`step_ms`), the host's wait
    for the device within it (`wait_ms`), the rest (`host_ms`: the host's own work when it is the longer
    side), and the share whose tokens came from a lookahead. None when no two such steps ran back to back."""
    intervals, waits, hosts, ahead = [], [], [], 0
    for step, following in zip(steps, steps[1:], strict=False):
        if not (step.decode == following.decode == batch and step.prefill == following.prefill == 0):
            continue
        interval = following.start - step.start
        intervals.append(interval)
        waits.append(step.wait_s)
        hosts.append(interval - step.wait_s)
        ahead += step.from_lookahead
    if not intervals:
        return None
    return {
        "steps": len(intervals),
        "step_ms": round(1e3 * statistics.median(intervals), 3),
        "wait_ms": round(1e3 * statistics.median(waits), 3),
        "host_ms": round(1e3 * statistics.median(hosts), 3),
        "lookahead_share": round(ahead / len(intervals), 3),
    }
