"""Prefix sharing in the embedded engine (CPU, fp32, tiny random models).

References are the same engine with sharing off (`prefix_cache=False`): greedy tokens must be equal; the
engine's own counters say how many prefill tokens were computed; the pool's refcounts say what is held.
"""

import asyncio

import pytest
import torch
from harness import with_engine

from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE as P
from miles.models.tiny import make_tiny_model

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"), arch="qwen2", init_std=0.2, seed=0)


def run(model_dir, body, **kwargs):
    return with_engine(body, model_path=model_dir, max_running_requests=16, max_total_tokens=16 * 512, **kwargs)


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 200, (n,), generator=g).tolist()


async def _group(engine, prompt: list[int], n: int, new: int) -> list[dict]:
    return await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": new, "n": n})


def test_group_of_8_prefills_its_prompt_once_with_equal_greedy_output(model_dir):
    prompt = _prompt(4 * P + 1)  # 4 full pages + the last token, which every sample computes itself

    async def body(engine):
        outs = await _group(engine, prompt, 8, 6)
        return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], engine

    shared, cached, engine = run(model_dir, body)
    plain, plain_cached, plain_engine = run(model_dir, body, prefix_cache=False)
    assert shared == plain
    stats, plain_stats = engine.prefix_cache_stats(), plain_engine.prefix_cache_stats()
    assert plain_stats["prefill_tokens_computed"] == 8 * len(prompt) and plain_cached == [0] * 8
    assert stats["prefill_tokens_requested"] == 8 * len(prompt)
    # the leader computes the prompt; the 7 others only its last token
    assert stats["prefill_tokens_computed"] == len(prompt) + 7
    assert sorted(cached) == [0] + [4 * P] * 7
    assert not plain_stats["enabled"] and plain_stats["cached_pages"] == 0


def test_a_10_turn_session_prefills_no_earlier_turn(model_dir):
    turns = [_prompt(2 * P + 3, seed=t) for t in range(10)]

    async def body(engine):
        history, computed, outputs = [], [], []
        for user in turns:
            history = history + user
            before = engine.prefix_cache_stats()["prefill_tokens_computed"]
            out = await engine.generate(input_ids=history, sampling_params={**GREEDY, "max_new_tokens": 5})
            computed.append(engine.prefix_cache_stats()["prefill_tokens_computed"] - before)
            outputs.append(out["output_ids"])
            history = history + out["output_ids"]
        return computed, outputs

    computed, outputs = run(model_dir, body)
    _, plain_outputs = run(model_dir, body, prefix_cache=False)
    assert outputs == plain_outputs
    assert computed[0] == len(turns[0])
    # this turn's tokens and at most one page of the history before it (its last token has no K/V)
    for t in range(1, 10):
        assert len(turns[t]) <= computed[t] <= len(turns[t]) + P, (t, computed)


def test_pages_are_released_after_requests_and_dropped_at_a_weight_update(model_dir):
    async def body(engine):
        cache = engine.runner.prefix_cache
        done = asyncio.ensure_future(_group(engine, _prompt(3 * P + 2), 4, 40))
        while len(engine.scheduler.running) < 4:  # the leader first, its 3 followers a step later
            await asyncio.sleep(0.001)
        held = min(cache.refcounts().values())  # every prompt page, held by every sample while it runs
        await done
        after = dict(cache.refcounts())
        await engine.pause_generation("retract")
        engine.load_weights(list(engine.named_weights())[:1])
        await engine.continue_generation()
        return held, after, cache.cached_pages, cache.generation

    held, after, pages_after_update, generation = run(model_dir, body)
    assert held == 4
    assert after and all(refs == 0 for refs in after.values())  # cached for later, referenced by no one
    assert pages_after_update == 0 and generation >= 1


def test_requests_after_a_weight_update_never_read_old_pages(model_dir, tmp_path):
    other = make_tiny_model(str(tmp_path / "other"), arch="qwen2", init_std=0.2, seed=1)
    prompt = _prompt(3 * P + 1)

    async def body(engine):
        await _group(engine, prompt, 2, 3)
        engine.load_weights_from_dir(other)
        before = engine.prefix_cache_stats()["prefill_tokens_computed"]
        out = await _group(engine, prompt, 1, 6)
        return out["output_ids"], engine.prefix_cache_stats()["prefill_tokens_computed"] - before

    got, computed = run(model_dir, body)

    async def fresh(engine):
        return (await _group(engine, prompt, 1, 6))["output_ids"]

    assert computed == len(prompt)
    assert got == run(other, fresh, prefix_cache=False)


def test_a_small_pool_evicts_unreferenced_pages_and_stays_correct(model_dir):
    prompts = [_prompt(3 * P + 5, seed=s) for s in range(6)]

    async def body(engine):
        outs = []
        for p in prompts:
            outs.append((await _group(engine, p, 2, 4))[0]["output_ids"])
        return outs, engine.runner.prefix_cache

    outs, cache = run(model_dir, body, prefix_cache_tokens=4 * P)
    plain, _ = run(model_dir, body, prefix_cache=False)
    assert outs == plain
    assert cache.evicted > 0 and cache.cached_pages <= 4


def test_hits_and_misses_admitted_together_prefill_apart_and_keep_input_logprobs(model_dir):
    """A step that admits a cache hit beside misses (one of them asking for its prompt's log-probs): the misses
    run as an ordinary prefill and the hit as an extend of its new tokens alone, not padded to a miss's prompt;
    tokens and input log-probs equal the engine's without sharing."""
    cached, fresh, scored = _prompt(3 * P + 1, seed=1), _prompt(3 * P + 5, seed=2), _prompt(2 * P + 3, seed=3)
    hit = cached[:-1] + _prompt(4, seed=4)  # the cached prompt's 3 full pages, then 4 new tokens

    async def body(engine):
        await engine.generate(input_ids=cached, sampling_params={**GREEDY, "max_new_tokens": 1})
        runner, extends = engine.runner, []
        plain_extend = runner._prefill_extend
        if runner.prefix_cache is not None:  # record each extend's rows and width
            runner._prefill_extend = lambda seqs, *a: extends.append([len(s) for s in seqs]) or plain_extend(seqs, *a)
        new = {**GREEDY, "max_new_tokens": 3}
        outs = await asyncio.gather(
            engine.generate(input_ids=hit, sampling_params=new),
            engine.generate(input_ids=fresh, sampling_params=new),
            engine.generate(input_ids=scored, sampling_params=new, return_logprob=True, logprob_start_len=0),
        )
        tokens = [o["output_ids"] for o in outs]
        return (
            tokens,
            outs[2]["meta_info"]["input_token_logprobs"],
            [o["meta_info"]["cached_tokens"] for o in outs],
            extends,
        )

    tokens, input_lps, cached_tokens, extends = run(model_dir, body)
    plain_tokens, plain_lps, _, _ = run(model_dir, body, prefix_cache=False)
    assert tokens == plain_tokens
    assert [t for _, t, _ in input_lps] == scored and input_lps[0][0] is None
    torch.testing.assert_close(
        [lp for lp, _, _ in input_lps[1:]], [lp for lp, _, _ in plain_lps[1:]], rtol=0, atol=1e-4
    )
    assert cached_tokens == [3 * P, 0, 0]
    assert extends == [[len(hit) - 3 * P]]  # one extend: the hit alone, its 4 new tokens
