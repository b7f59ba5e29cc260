"""Continuous-batching scheduler of the embedded engine.

Every iteration: drop aborted requests, retract requests whose KV is stale (weights changed), admit
waiting requests into free slots, then run one step = prefill of the newcomers + one decode token for
the requests already running, sample, and retire finished requests. Requests therefore join and leave
the running batch at every step.

Slots: running request i lives in KV slot i. When a request leaves, the last running request moves
into its slot (one sequence's KV copied), keeping slots 0..R-1 contiguous so decode reads plain views.

Pause modes: `abort` finishes everything with finish_reason abort; `retract` moves running requests
back to the head of the queue keeping their generated tokens (KV dropped, re-prefilled after
`continue`); `in_place` freezes them with their KV, but any weight load in between bumps the KV epoch
and they are re-prefilled as well, so pre-update KV is never used.

The step's tensor work runs on the runner's device thread (`ModelRunner.in_worker`); all bookkeeping
stays on the event loop thread.

Lookahead (on by default with CUDA graphs): once a step's tokens are on the device, the next decode step of the same
requests is launched right away, feeding those tokens, before the host does the step's bookkeeping;
the host work then overlaps the GPU work. The next iteration uses that lookahead for every request
still running (a removed request's row is simply ignored; slot compaction copies the KV the lookahead
wrote) and discards it if the weights or the KV epoch changed meanwhile. It is not used while any
request samples from its own generator (its random stream would advance for a discarded step). Sampling a
step's tokens and launching the lookahead are step_sampling.py's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable

import torch

from miles.engines.embedded.decode_plan import apply_step
from miles.engines.embedded.logprob_extras import Extras, input_logprobs
from miles.engines.embedded.moe import Routing, routed_rows
from miles.engines.embedded.prefix_sharing import PrefixSharing
from miles.engines.embedded.request import Lookahead, Request, StepCounts, StepResult, StepTime
from miles.engines.embedded.runner import ModelRunner
from miles.engines.embedded.step_sampling import StepSampling

logger = logging.getLogger(__name__)

# Seconds slept after every engine step (0: off); set by tests and benches through the environment, read when
# a scheduler is built (not at import: a worker forked from a warm server imported this module long before).
STEP_DELAY_ENV = "MILES_ENGINE_STEP_DELAY_S"


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        check_stop_strings: Callable[[Request], dict | None],
        weight_version: Callable[[], int],
        max_prefill_tokens: int,
        batch_generator: torch.Generator,
        inline_step_s: float = 0.0,
        lookahead: bool = False,
    ):
        self.runner = runner
        self.check_stop_strings = check_stop_strings
        self.weight_version = weight_version
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.paused = False
        self.extras_in_use = False  # a request asked for top-k / token-id log-probs: steps look for them
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = False
        self.inline_step_s = inline_step_s
        self._decode_step_s = float("inf") if inline_step_s <= 0 else 0.0  # moving average of decode steps
        self._last_compute_s = 0.0
        self.lookahead = lookahead
        self._lookahead: Lookahead | None = None
        self.step_delay_s = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        self.sampling = StepSampling(runner, batch_generator)  # sampling batch, decode plan, lookahead launch
        self._aborts = False  # an abort was asked for since the last reap
        self._checked_epoch = -1  # every running request's KV was of this epoch at the last look
        self.lookahead_used = 0  # decode steps served by a lookahead (tests and benches read these)
        self.lookahead_dropped = 0
        self.counts = StepCounts()
        self.timeline: list[StepTime] | None = None  # a list: every step's host timings are appended (benches)
        self.sharing = PrefixSharing(runner)  # prefix sharing and the prefill token counters

    # ---- control (event loop thread) ---------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.extras_in_use = self.extras_in_use or req.extras.wanted
        self.waiting.append(req)
        self._wakeup.set()

    def abort(self, rids: set[str] | None) -> None:
        """Mark requests (all when rids is None) aborted; they finish with their partial output."""
        for req in [*self.running, *self.waiting]:
            if rids is None or req.rid in rids:
                req.abort_requested = True
                self._aborts = True
        if self._idle.is_set():
            self._reap_aborted()
        self._wakeup.set()

    async def pause(self, mode: str) -> None:
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"pause mode {mode!r} is not one of 'abort', 'in_place', 'retract'")
        self.paused = True
        self._unpaused.clear()
        await self._idle.wait()  # the step in flight completes first
        if mode == "abort":
            self.abort(None)
        elif mode == "retract":
            self.retract_all()

    def resume(self) -> None:
        self.paused = False
        self._unpaused.set()
        self._wakeup.set()

    async def wait_unpaused(self) -> None:
        """Return once generation is not paused (work outside the scheduler waits for weight updates too)."""
        await self._unpaused.wait()

    def retract_all(self) -> None:
        """Move running requests back to the head of the queue; their KV is dropped, tokens kept."""
        for req in reversed(self.running):
            req.kv_epoch = -1
            self.sharing.drop(req)
            self.waiting.appendleft(req)
        self.running.clear()

    def take_counts(self) -> StepCounts:
        """The counts since the previous call (or the start), and a fresh start."""
        counts, self.counts = self.counts, StepCounts()
        return counts

    def wake(self) -> None:
        self._wakeup.set()

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- loop ------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """The scheduler task. On an unexpected error every pending request fails instead of hanging."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("engine scheduler crashed")
            self._fail_all(RuntimeError(f"engine scheduler crashed: {e!r}"))
            raise

    def abort_pending(self) -> None:
        """Finish every request still queued or running with finish_reason abort (engine shutdown)."""
        for req in [*self.running, *self.waiting]:
            self.sharing.drop(req)
            self._finish(req, {"type": "abort", "message": "engine shut down"})
        self.running.clear()
        self.waiting.clear()

    async def _loop(self) -> None:
        while not self._stopped:
            start = time.perf_counter()
            self._reap_aborted()
            if self.paused or not self.runner.ready or not (self.running or self.waiting):
                self._drop_lookahead()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._retract_stale()
            n_decode = len(self.running)
            self._admit()
            prefill = self.running[n_decode:]
            self._idle.clear()
            try:
                result = await self._run_step(self.running[:n_decode], prefill)
            except Exception as e:  # a failing step fails its requests, not the engine
                logger.exception("engine step failed")
                self._lookahead = None
                self._fail_all(RuntimeError(f"engine step failed: {e!r}"))
                continue
            finally:
                self._idle.set()
            counts = self.counts
            counts.steps += 1
            counts.prefill_steps += bool(prefill)
            counts.prefilled += len(prefill)
            counts.step_s += self._last_compute_s
            self._lookahead = result.lookahead  # runs on the GPU while the host does the bookkeeping
            self._apply(result, n_decode)
            if self.timeline is not None:
                end = time.perf_counter()
                self.timeline.append(
                    StepTime(start, end, result.wait_s, n_decode, len(prefill), result.from_lookahead)
                )

    def _drop_lookahead(self) -> None:
        if self._lookahead is not None:
            self._lookahead = None
            self.lookahead_dropped += 1

    async def _run_step(self, decode: list[Request], prefill: list[Request]) -> StepResult:
        """Run one step on the device thread, or inline when decode steps are known to be short.

        A thread hand-off costs about as much as a whole decode step of a tiny model on CPU, so steps
        whose recent duration is under `inline_step_s` run on the loop (which is yielded every step).
        """
        if prefill or (self._decode_step_s > self.inline_step_s and self._lookahead is None):
            result = await self.runner.in_worker(self._compute, decode, prefill)
        else:
            result = self._compute(decode, prefill)
            await asyncio.sleep(0)  # let the loop serve other work between inline steps
        if not prefill:
            self._decode_step_s = 0.8 * self._decode_step_s + 0.2 * self._last_compute_s
        if self.step_delay_s > 0:  # tests/benches: make generation dominate like on a GPU, without using CPU
            await asyncio.sleep(self.step_delay_s)
        return result

    def _reap_aborted(self) -> None:
        if not self._aborts:
            return
        self._aborts = False
        if any(r.abort_requested for r in self.waiting):
            keep = collections.deque()
            for req in self.waiting:
                if req.abort_requested:
                    self._finish(req, {"type": "abort", "message": "aborted"})
                else:
                    keep.append(req)
            self.waiting = keep
        for i in reversed(range(len(self.running))):
            if self.running[i].abort_requested:
                self._remove_running(i, {"type": "abort", "message": "aborted"})

    def _retract_stale(self) -> None:
        epoch = self.runner.kv_epoch
        if epoch == self._checked_epoch:  # requests admitted since were prefilled in this epoch
            return
        self._checked_epoch = epoch
        for i in reversed(range(len(self.running))):
            req = self.running[i]
            if req.kv_epoch != epoch:
                logger.debug("re-prefilling %s: KV epoch %d != %d", req.rid, req.kv_epoch, epoch)
                self.sharing.drop(self._remove_slot(i))
                req.kv_epoch = -1
                self.waiting.appendleft(req)

    def _admit(self) -> None:
        """Move waiting requests into the running batch while the prefill's padded size allows. With prefix
        sharing, each takes its cached pages, and one whose prefix a request admitted in this step is about
        to compute waits for the next step (then its prefix is cached: a group's prompt is prefilled once)."""
        width = 0
        count = 0
        first_new = len(self.running)
        sharing = self.sharing
        deferred: list[Request] = []
        admitted: dict[tuple, list[Request]] = {}  # first page of tokens -> requests admitted now
        while self.waiting and len(self.running) < self.runner.max_running_requests:
            req = self.waiting[0]
            lease = sharing.take(req)
            if sharing.waits(req, lease, admitted):
                deferred.append(self.waiting.popleft())
                continue
            new_width = max(width, req.seq_len - sharing.cached_tokens(lease))
            if count and new_width * (count + 1) > self.max_prefill_tokens:
                sharing.release(lease)
                break
            width, count = new_width, count + 1
            sharing.admit(req, lease, admitted)
            self.running.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(deferred))
        # cache hits after the requests computed from position 0: the runner prefills the two apart
        self.running[first_new:] = sorted(self.running[first_new:], key=lambda r: bool(r.lease and r.lease.pages))

    # ---- step (worker thread) ------------------------------------------------------------------------
    def _compute(self, decode: list[Request], prefill: list[Request]) -> StepResult:
        start = time.perf_counter()
        try:
            return self._compute_locked(decode, prefill)
        finally:
            self._last_compute_s = time.perf_counter() - start

    def _compute_locked(self, decode: list[Request], prefill: list[Request]) -> StepResult:
        ahead, self._lookahead = self._lookahead, None
        with self.runner.lock:  # re-entrant: the version and the forward see the same weights
            version = self.weight_version()
            epoch = self.runner.kv_epoch
            rows = ahead.rows(decode) if ahead is not None and decode else None
            if ahead is not None and (rows is None or ahead.kv_epoch != epoch or ahead.weight_version != version):
                ahead = None
                self.lookahead_dropped += 1
            logits, input_lps = [], {}
            prefill_routing = Routing() if any(r.routed is not None for r in prefill) else None
            decode_routing = Routing() if ahead is None and any(r.routed is not None for r in decode) else None
            if prefill:
                prefill_logits, input_lps = self._prefill(prefill, len(decode), epoch, prefill_routing)
            if decode and ahead is None:
                positions = [r.seq_len - 1 for r in decode]
                logits.append(self.runner.decode([r.last_token for r in decode], positions, decode_routing))
            if prefill:
                logits.append(prefill_logits)
            reqs = decode + prefill
            if ahead is not None:
                self.lookahead_used += 1
            tokens_dev, lps_dev, output_extras = self.sampling.sample_tokens(
                reqs, prefill, logits, ahead, rows, self.extras_in_use
            )
            look_ahead = self._may_look_ahead(reqs)
            tokens, lps, lookahead, wait_s = self.sampling.fetch_results(
                reqs, tokens_dev, lps_dev, epoch, version, look_ahead
            )
            routed = routed_rows(decode, prefill, decode_routing, prefill_routing)
            return StepResult(
                tokens, lps, input_lps, version, lookahead, output_extras, routed, ahead is not None, wait_s
            )

    def _prefill(
        self, prefill: list[Request], n_decode: int, epoch: int, routing: Routing | None
    ) -> tuple[torch.Tensor, dict[int, tuple[list[float | None], Extras | None]]]:
        """Prefill the newcomers into the slots after the `n_decode` running ones: their last positions'
        logits, and the input log-probs of those that asked (step index ->)."""
        # routing is recorded by a forward over every token: such a step reuses no cached page
        seqs, starts = self.sharing.load(prefill, n_decode, reuse=routing is None)
        want_all = [r.wants_input_logprobs for r in prefill]
        res = self.runner.prefill(seqs, n_decode, want_all, starts, routing)
        self.sharing.share(prefill, n_decode)
        input_lps = {}
        for j, (req, full) in enumerate(zip(prefill, res.all_logits, strict=True)):
            if full is not None:
                input_lps[n_decode + j] = input_logprobs(req, full)
            req.kv_epoch = epoch
            req.prefill_count += 1
        return res.last_logits, input_lps

    def _may_look_ahead(self, reqs: list[Request]) -> bool:
        """A lookahead needs no private generators and room for one more token in every request."""
        if not self.lookahead or self.paused or not reqs:
            return False
        # the lookahead's forward records no routing and samples from the batch generator only; at least
        # one request must go on after this step (else the lookahead is wasted work)
        return self.sampling.plan(reqs).may_look_ahead()

    # ---- bookkeeping (event loop thread) -----------------------------------------------------------------
    def _apply(self, result: StepResult, n_decode: int) -> None:
        # the host's share of every step, once per token: decode_plan.apply_step
        finished = apply_step(
            self.running, result, self.sampling.plan(self.running), self.check_stop_strings, self.runner.max_seq_len
        )
        self._retire(finished)

    def _retire(self, finished: list[tuple[int, dict]]) -> None:
        # their pages go into the prefix cache together, from their slots as they are before any moves
        self.sharing.drop_many([(self.running[i], self.running[i].seq_len - 1, i) for i, _ in finished])
        for i, reason in reversed(finished):
            self._finish(self._remove_slot(i), reason)
        if not self.running:
            self.sampling.drop_plan()  # it holds the finished requests

    def _remove_slot(self, i: int) -> Request:
        """Take request i out of the running batch; the last request moves into slot i."""
        req = self.running[i]
        last = len(self.running) - 1
        if i != last:
            mover = self.running[last]
            self.runner.move_slot(last, i, mover.seq_len)
            self.running[i] = mover
        self.running.pop()
        return req

    def _remove_running(self, i: int, reason: dict) -> None:
        req = self.running[i]
        self.sharing.drop(req, req.seq_len - 1, i)  # the last sampled token has no K/V yet
        self._finish(self._remove_slot(i), reason)

    def _finish(self, req: Request, reason: dict) -> None:
        req.finish_reason = reason
        if not req.future.done():
            req.future.set_result(req)

    def _fail_all(self, error: Exception) -> None:
        for req in [*self.running, *self.waiting]:
            self.sharing.drop(req)
            if not req.future.done():
                req.future.set_exception(error)
        self.running.clear()
        self.waiting.clear()
