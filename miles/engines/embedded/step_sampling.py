"""The sampling half of a scheduler step, and the lookahead launch (scheduler.py says when one is used).

`StepSampling` keeps what stays the same while one batch of requests runs: its sampling batch (`SamplingBatch`,
made again only when the requests' parameters change) and its decode plan (decode_plan.py, made again when the
batch changes). Per step it samples the tokens of the rows that are not served by a lookahead (`sample`), then
brings the step's tokens and log-probs to the host (`fetch_results`), first queueing the next decode step of the
same requests where the scheduler allows one: on CUDA behind the copy of this step's results, so the host's
bookkeeping overlaps it. The step's calls run on the runner's device thread (or inline on the event loop); the
event loop's bookkeeping reads `plan` between steps.
"""

from __future__ import annotations

import time

import torch

from miles.engines.embedded.decode_plan import DecodePlan
from miles.engines.embedded.logprob_extras import Extras, output_extras
from miles.engines.embedded.request import Lookahead, Request
from miles.engines.embedded.runner import ModelRunner
from miles.engines.embedded.sampler import SamplingBatch, SamplingParams, sample


class StepSampling:
    def __init__(self, runner: ModelRunner, batch_generator: torch.Generator):
        self.runner = runner
        self.batch_generator = batch_generator
        self._sampling_cache: tuple[list[SamplingParams], SamplingBatch] | None = None
        self._decode_plan: DecodePlan | None = None  # the running batch's (decode_plan.py)

    def drop_plan(self) -> None:
        """Forget the decode plan (the batch emptied: the plan holds the finished requests)."""
        self._decode_plan = None

    def plan(self, reqs: list[Request]) -> DecodePlan:
        """The plan of this batch of requests (in step order), made again whenever the batch changed."""
        plan = self._decode_plan
        if plan is None or not plan.covers(reqs):
            plan = self._decode_plan = DecodePlan.of(reqs, self.runner.max_seq_len)
        return plan

    def sampling_batch(self, params: list[SamplingParams]) -> SamplingBatch:
        """The batch's sampling parameters; reused while the same requests run in the same order (the list
        comparison checks identity first, element by element, in C). A batch equal by value (new requests
        with the same parameters) is reused too, and the new list is kept, so that the next steps compare
        by identity again rather than field by field."""
        cached = self._sampling_cache
        if cached is not None and cached[0] == params:
            batch = cached[1]
        else:
            batch = SamplingBatch(params)
        self._sampling_cache = (params, batch)
        return batch

    def sample_tokens(
        self,
        reqs: list[Request],
        prefill: list[Request],
        logits: list[torch.Tensor],
        ahead: Lookahead | None,
        rows: range | list[int] | None,
        extras_in_use: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, Extras]]:
        """This step's (tokens, log-probs) on the device for `reqs` in step order: the decode rows from the
        lookahead when one is used, the rest sampled from `logits`; and the extras asked for (step index ->)."""
        sampled = reqs if ahead is None else prefill
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if ahead is not None:
            parts.append(ahead.take(rows))
        step_extras: dict[int, Extras] = {}
        if sampled:
            batch = self.sampling_batch([r.params for r in sampled])
            step_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            if extras_in_use:
                step_extras = output_extras(sampled, step_logits, len(reqs) - len(sampled))
            parts.append(
                sample(
                    step_logits,
                    batch,
                    [r.generator for r in sampled],
                    self.batch_generator,
                    fused=self.runner.fused_kernels,
                )
            )
        tokens_dev = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        lps_dev = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return tokens_dev, lps_dev, step_extras

    def fetch_results(
        self,
        reqs: list[Request],
        tokens_dev: torch.Tensor,
        lps_dev: torch.Tensor,
        epoch: int,
        version: int,
        look_ahead: bool,
    ) -> tuple[list[int], list[float], Lookahead | None, float]:
        """The step's tokens and log-probs on the host, the next decode step launched ahead where allowed
        (on CUDA queued behind the copy of this step's results, so the host work overlaps it), and the
        seconds the host waited for the results (on CUDA: for the device to reach them)."""
        lookahead = None
        if not look_ahead or tokens_dev.device.type != "cuda":
            wait_start = time.perf_counter()
            tokens, lps = tokens_dev.tolist(), lps_dev.tolist()
            wait_s = time.perf_counter() - wait_start
            if look_ahead:  # nothing runs asynchronously here: results, then the lookahead
                lookahead = self._launch_lookahead(reqs, tokens_dev, epoch, version)
            return tokens, lps, lookahead, wait_s
        # copy this step's results out first, then queue the next decode step behind the copy
        host_tokens = torch.empty(tokens_dev.shape, dtype=tokens_dev.dtype, pin_memory=True)
        host_lps = torch.empty(lps_dev.shape, dtype=lps_dev.dtype, pin_memory=True)
        host_tokens.copy_(tokens_dev, non_blocking=True)
        host_lps.copy_(lps_dev, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        lookahead = self._launch_lookahead(reqs, tokens_dev, epoch, version)
        wait_start = time.perf_counter()
        copied.synchronize()
        wait_s = time.perf_counter() - wait_start
        return host_tokens.tolist(), host_lps.tolist(), lookahead, wait_s

    def _launch_lookahead(self, reqs: list[Request], tokens: torch.Tensor, epoch: int, version: int) -> Lookahead:
        """Queue the next decode step of `reqs`, fed this step's device `tokens` at their next positions."""
        plan = self.plan(reqs)
        logits = self.runner.decode(tokens, plan.positions())
        batch = self.sampling_batch(plan.params)
        next_tokens, next_lps = sample(
            logits, batch, [None] * len(reqs), self.batch_generator, fused=self.runner.fused_kernels
        )
        return Lookahead(reqs, next_tokens, next_lps, epoch, version)
