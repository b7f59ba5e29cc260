"""The scheduler's plain-batch bookkeeping (decode_plan.py) finishes every request at the same token, with
the same reason, log-probs and weight versions, as the request-by-request path; and a plan's lookahead
answer is the per-request rule's, step after step."""

import asyncio
import random

import pytest
import torch

from miles.engines.embedded import decode_plan
from miles.engines.embedded.decode_plan import DecodePlan
from miles.engines.embedded.request import Request, StepResult
from miles.engines.embedded.sampler import SamplingParams
from miles.engines.embedded.scheduler import Scheduler

MAX_SEQ_LEN = 128
STOP_STRING_RID = "with-stop-string"


class StubRunner:
    """What the scheduler's bookkeeping reads of a runner; no model (the steps are scripted)."""

    max_seq_len = MAX_SEQ_LEN
    max_running_requests = 64
    kv_epoch = 0
    prefix_cache = None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        pass


def _token(rid: str, index: int) -> int:
    """The scripted token of request `rid` at output index `index`: the same whatever the batch's order."""
    return random.Random(f"{rid}/{index}").randrange(60)


def _requests(loop, seed: int, with_stop_string: bool) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(24):
        prompt = [1] * rng.randrange(1, 100)  # some reach the context limit first
        params = SamplingParams(max_new_tokens=rng.choice([1, 2, 5, 9, 17, 40, 80]))
        stop_ids = frozenset(rng.sample(range(60), rng.choice([0, 1, 2])))
        reqs.append(Request(f"r{i}", prompt, params, True, -1, loop.create_future(), stop_ids=stop_ids))
    if with_stop_string:  # never matches; makes every batch it runs in go request by request
        params = SamplingParams(max_new_tokens=MAX_SEQ_LEN - 2, stop=["never"])  # outlives the others
        reqs.insert(0, Request(STOP_STRING_RID, [1], params, True, -1, loop.create_future()))
    return reqs


def _drive(reqs: list[Request], admit_every: int, monkeypatch) -> tuple[dict, int]:
    """Run the scheduler's bookkeeping over scripted steps until every request finished: (rid -> what
    it finished with, steps that went through the plain path)."""
    sched = Scheduler(
        StubRunner(),
        check_stop_strings=lambda req: None,
        weight_version=lambda: 0,
        max_prefill_tokens=1 << 20,
        batch_generator=torch.Generator(),
    )
    plain_steps = 0
    original = decode_plan.finished_plain

    def counting(running, max_seq_len):
        nonlocal plain_steps
        plain_steps += 1
        return original(running, max_seq_len)

    monkeypatch.setattr(decode_plan, "finished_plain", counting)
    pending, step = [r for r in reqs if r.rid != STOP_STRING_RID], 0
    sched.running.extend(r for r in reqs if r.rid == STOP_STRING_RID)  # it runs from the first step to the last
    while pending or sched.running:
        assert step < 10 * MAX_SEQ_LEN, "requests outlived every limit"  # a broken finish check fails, not hangs
        if step % admit_every == 0 and pending:  # requests join between steps, two at a time
            sched.running.extend(pending[:2])
            del pending[:2]
        tokens = [_token(r.rid, len(r.output_ids)) for r in sched.running]
        logprobs = [-0.01 * t for t in tokens]
        sched._apply(StepResult(tokens, logprobs, {}, weight_version=step // 7), len(sched.running))
        step += 1
    done = {
        r.rid: (r.output_ids, r.output_logprobs, r.output_versions, r.finish_reason)
        for r in reqs
        if r.rid != STOP_STRING_RID
    }
    return done, plain_steps


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("admit_every", [1, 3])
def test_plain_batches_finish_every_request_as_the_per_request_path_does(seed, admit_every, monkeypatch):
    loop = asyncio.new_event_loop()
    try:
        reqs = _requests(loop, seed, with_stop_string=False)
        budget = {r.rid: r.params.max_new_tokens for r in reqs}
        plain, plain_checks = _drive(reqs, admit_every, monkeypatch)
        per_request, per_request_checks = _drive(
            _requests(loop, seed, with_stop_string=True), admit_every, monkeypatch
        )
    finally:
        loop.close()
    assert plain == per_request
    assert plain_checks > 0 and per_request_checks == 0  # each side took the path it was meant to
    reasons = {reason["type"] for *_, reason in plain.values()}
    assert reasons == {"stop", "length"}  # both kinds of finish were exercised
    by_context = [
        rid for rid, (ids, *_, reason) in plain.items() if reason["type"] == "length" and len(ids) < budget[rid]
    ]
    assert by_context  # some met the context limit before their max_new_tokens
    for ids, lps, versions, reason in plain.values():
        assert len(ids) == len(lps) == len(versions)
        if reason["type"] == "stop":
            assert reason["matched"] == ids[-1]


def _old_may_look_ahead(reqs: list[Request]) -> bool:
    """The per-request rule the plan replaces (without the scheduler's own on / paused / empty checks)."""
    if any(
        r.generator is not None
        or r.seq_len + 1 >= MAX_SEQ_LEN
        or r.params.max_new_tokens == 0
        or r.extras.wanted
        or r.routed is not None
        for r in reqs
    ):
        return False
    return any(len(r.output_ids) + 1 < r.params.max_new_tokens for r in reqs)


@pytest.mark.parametrize("seed", range(6))
def test_a_plans_lookahead_answer_is_the_per_request_rule_at_every_step(seed):
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    try:
        reqs = [
            Request(
                f"r{i}",
                [1] * rng.randrange(1, 50),
                SamplingParams(max_new_tokens=rng.choice([0, 1, 3, 12, 30])),
                False,
                -1,
                loop.create_future(),
                generator=torch.Generator() if rng.random() < 0.05 else None,
            )
            for i in range(rng.randrange(1, 6))
        ]
        for r in reqs:
            r.output_ids.extend([5] * rng.randrange(0, 3))
        plan = DecodePlan.of(reqs, MAX_SEQ_LEN)
        for _ in range(40):
            assert plan.may_look_ahead() == _old_may_look_ahead(reqs)
            assert plan.positions() == [r.seq_len for r in reqs]
            plan.append_step([7] * len(reqs), [0.0] * len(reqs), 0)
    finally:
        loop.close()
