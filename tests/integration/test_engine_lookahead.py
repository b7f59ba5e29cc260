"""The scheduler's lookahead (the next decode step launched before the host's bookkeeping) changes
no output: on CPU it runs without overlap but through the same bookkeeping, so greedy outputs with and
without it must agree token for token while requests join, finish, are aborted and weights change."""

import asyncio
import re

import pytest
import torch

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.request import Lookahead, StepTime, decode_step_summary
from miles.models.tiny import make_tiny_model

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "old": make_tiny_model(str(root / "old"), arch="qwen2", init_std=0.2, seed=0),
        "new": make_tiny_model(str(root / "new"), arch="qwen2", init_std=0.2, seed=1),
    }


def _run(model_path: str, lookahead: bool, body, **kw):
    async def main():
        engine = EmbeddedEngine(model_path, lookahead=lookahead, **kw)
        await engine.start()
        try:
            return await body(engine), engine.scheduler
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (3 + (7 * i) % 11,), generator=g).tolist() for i in range(count)]


def test_outputs_equal_without_lookahead_while_requests_join_and_leave(model_dirs):
    prompts = _prompts(40)
    params = [{**GREEDY, "max_new_tokens": 3 + (5 * i) % 17} for i in range(40)]

    async def body(engine):
        outs = await asyncio.gather(
            *(
                engine.generate(input_ids=p, sampling_params=sp, return_logprob=True)
                for p, sp in zip(prompts, params, strict=True)
            )
        )
        return [(o["output_ids"], [x[0] for x in o["meta_info"]["output_token_logprobs"]]) for o in outs]

    # 16 slots for 40 requests of 3..19 tokens: admissions and removals (slot moves) at most steps
    plain, _ = _run(model_dirs["old"], False, body, max_running_requests=16)
    ahead, sched = _run(model_dirs["old"], True, body, max_running_requests=16)
    assert sched.lookahead_used > 10, (sched.lookahead_used, sched.lookahead_dropped)
    for (ids_a, lps_a), (ids_b, lps_b), sp in zip(plain, ahead, params, strict=True):
        assert len(ids_b) == sp["max_new_tokens"]
        assert ids_a == ids_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b, strict=True)) < 1e-5


def test_abort_with_lookahead_leaves_neighbours_untouched(model_dirs):
    prompts = _prompts(4)

    async def body(engine):
        long = asyncio.create_task(
            engine.generate(input_ids=prompts[0], rid="long", sampling_params={**GREEDY, "max_new_tokens": 500})
        )
        others = [
            asyncio.create_task(engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 40}))
            for p in prompts[1:]
        ]
        while not any(r.rid == "long" and len(r.output_ids) >= 5 for r in engine.scheduler.running):
            await asyncio.sleep(0.001)
        engine.abort("long")
        return await long, [(await t)["output_ids"] for t in others]

    (aborted, ahead), sched = _run(model_dirs["old"], True, body)
    (_, plain), _ = _run(model_dirs["old"], False, body)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and 5 <= len(aborted["output_ids"]) < 500
    assert ahead == plain
    assert sched.lookahead_used > 0


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_lookahead_never_serves_tokens_of_old_weights_after_an_update(model_dirs, mode):
    prompt = _prompts(3)[2]

    async def body(engine):
        task = asyncio.create_task(engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30}))
        while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 6:
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode)
        engine.load_weights_from_dir(model_dirs["new"])
        engine.weight_version = 1
        await engine.continue_generation()
        return await task

    out, _ = _run(model_dirs["old"], True, body)
    versions = out["meta_info"]["output_token_weight_versions"]
    k = versions.index(1)
    assert k >= 6 and versions == [0] * k + [1] * (30 - k)

    async def reference(engine):  # the new weights continuing prompt + the tokens before the pause
        cont = await engine.generate(
            input_ids=prompt + out["output_ids"][:k], sampling_params={**GREEDY, "max_new_tokens": 30 - k}
        )
        return cont["output_ids"]

    expected, _ = _run(model_dirs["new"], False, reference)
    assert out["output_ids"][k:] == expected


def test_step_counts_say_how_a_burst_was_batched(model_dirs, caplog):
    """8 requests at once, 5 tokens each, in 8 slots: one prefill step for all of them, then decode steps
    only; setting the weight version logs those counts and starts new ones."""
    prompts = _prompts(8)

    async def body(engine):
        await asyncio.gather(
            *(engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 5}) for p in prompts)
        )
        with caplog.at_level("INFO", logger="miles.engines.embedded.engine"):
            engine.weight_version = 7
        return engine.scheduler.counts

    after, sched = _run(model_dirs["old"], False, body, max_running_requests=8)
    logged = [r.getMessage() for r in caplog.records if "weight_version 7" in r.getMessage()]
    # the prefill step samples each request's first token, so 4 decode steps follow it
    assert len(logged) == 1 and re.fullmatch(
        r"weight_version 7; served before it: 8 requests in 5 steps \(1 with prefill, \d+\.\d{3} s in steps\)",
        logged[0],
    ), logged
    assert (after.steps, after.prefilled) == (0, 0)


def test_timeline_records_each_step_and_the_decode_summary_reads_it(model_dirs):
    """With `timeline` set, every step is recorded: 8 requests of 6 tokens in 8 slots run one prefill step
    and 5 decode steps, each served by the lookahead its previous step launched (the prefill step's
    included); the summary covers the decode steps that follow one another (4 intervals) and splits each
    into the wait and the rest."""
    prompts = _prompts(8)

    async def body(engine):
        engine.scheduler.timeline = []
        await asyncio.gather(
            *(engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 6}) for p in prompts)
        )
        return engine.scheduler.timeline

    steps, _ = _run(model_dirs["old"], True, body, max_running_requests=8)
    assert [(s.decode, s.prefill) for s in steps] == [(0, 8)] + [(8, 0)] * 5
    assert [s.from_lookahead for s in steps] == [False] + [True] * 5
    assert all(a.start <= a.end <= b.start for a, b in zip(steps, steps[1:], strict=False))
    summary = decode_step_summary(steps, 8)
    assert summary["steps"] == 4 and summary["lookahead_share"] == 1.0
    assert summary["step_ms"] > 0 and 0 <= summary["wait_ms"] <= summary["step_ms"]
    assert summary["host_ms"] == pytest.approx(summary["step_ms"] - summary["wait_ms"], abs=summary["step_ms"])
    assert decode_step_summary(steps, 4) is None  # no step of that batch


def test_decode_summary_takes_medians_over_back_to_back_full_steps():
    def step(start, wait, decode=4, prefill=0, ahead=True):
        return StepTime(start, start + 0.0005, wait, decode, prefill, ahead)

    # a prefill step and a partial batch interrupt the run: only 0->1, 1->2 and 4->5 are intervals
    steps = [
        step(0.000, 0.0004),
        step(0.001, 0.0006, ahead=False),
        step(0.003, 0.0002),
        step(0.004, 0, prefill=2),
        step(0.010, 0.001),
        step(0.012, 0.0),
        step(0.013, 0.0, decode=3),
    ]
    summary = decode_step_summary(steps, 4)
    # intervals 1, 2 and 2 ms; waits 0.4, 0.6 and 1.0 ms; the rest 0.6, 1.4 and 1.0 ms; 2 of 3 looked ahead
    assert summary == {"steps": 3, "step_ms": 2.0, "wait_ms": 0.6, "host_ms": 1.0, "lookahead_share": 0.667}


def test_a_lookahead_finds_its_rows_by_identity_and_by_index():
    """The same requests in order take the lookahead's leading rows as a view; after a slot move they are
    picked by index; a request that was not in the step voids it."""
    a, b, c = (object() for _ in range(3))
    tokens = torch.arange(3)
    ahead = Lookahead([a, b, c], tokens, tokens.float(), 0, 0)
    assert ahead.rows([a, b]) == range(2)
    assert ahead.take(ahead.rows([a, b]))[0].data_ptr() == tokens.data_ptr()  # a view, no copy
    assert ahead.rows([c, b]) == [2, 1] and ahead.take([2, 1])[0].tolist() == [2, 1]
    assert ahead.rows([a, object()]) is None
