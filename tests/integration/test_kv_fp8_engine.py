"""The embedded engine with an FP8 KV cache (SGLang's --kv-cache-dtype; CPU, fp32 model, tiny random models).

The reference for a generation's log-probs is the same engine with its cache in the model's dtype scoring the
same tokens by prefill (no cache read); the yardstick for "close" is another random model's log-probs.
"""

import pytest
import torch
from harness import prefill_scorer, with_engine

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE as P
from miles.engines.http_front import engine_from_args, parse_engine_args
from miles.models.tiny import make_tiny_model

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = torch.randint(3, 200, (4 * P + 1,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return [make_tiny_model(str(root / f"m{seed}"), arch="qwen2", init_std=0.2, seed=seed) for seed in (0, 1)]


def run(path: str, body, **kwargs):
    return with_engine(body, model_path=path, max_running_requests=8, max_total_tokens=8 * 256, **kwargs)


async def _greedy(engine, n: int = 1) -> list[dict]:
    out = await engine.generate(
        input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 24, "n": n}, return_logprob=True
    )
    return out if n > 1 else [out]


def _scored(ids: list[int]):
    """A body scoring `ids` after PROMPT by prefill: log p of each, from an engine's forward without its cache."""
    return prefill_scorer(PROMPT, ids)


def _generation(engine_out: dict) -> tuple[list[int], torch.Tensor]:
    lps = [lp for lp, _, _ in engine_out["meta_info"]["output_token_logprobs"]]
    return engine_out["output_ids"], torch.tensor(lps)


def test_greedy_decoding_over_an_fp8_cache_stays_close_to_the_full_precision_cache(model_dirs):
    """Each format's generated tokens, scored by the fp32-cache engine: the per-token gap is not zero (the
    cache is FP8), a tenth of another model's at most, and e5m2's (2 mantissa bits) above e4m3's (3)."""
    gaps = {}
    for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):

        async def body(engine):
            return _generation((await _greedy(engine))[0]), engine.runner.kv.k.dtype

        (ids, lps), stored = run(model_dirs[0], body, kv_cache_dtype=name)
        assert stored == dtype and torch.isfinite(lps).all() and len(ids) == 24
        exact, other = run(model_dirs[0], _scored(ids)), run(model_dirs[1], _scored(ids))
        gap, model_gap = (lps - exact).abs().mean().item(), (other - exact).abs().mean().item()
        assert 0 < gap < model_gap / 10, (name, gap, model_gap)
        gaps[name] = gap
    assert gaps["fp8_e4m3"] < gaps["fp8_e5m2"], gaps


def test_a_group_shares_its_prompts_fp8_pages(model_dirs):
    """8 samples of one prompt: the leader prefills it, the 7 others load its 4 full FP8 pages and compute
    the last token (over the FP8 prefix); they agree among themselves and stay close to sharing off, whose
    prefill attends over fresh keys in all but its last layer (the first token's log-prob: 0.15 apart here)."""

    async def body(engine):
        outs = await _greedy(engine, n=8)
        pool = engine.runner.prefix_cache
        return [_generation(o) for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], engine, pool

    shared, cached, engine, pool = run(model_dirs[0], body, kv_cache_dtype="fp8_e4m3")
    plain, _, _, _ = run(model_dirs[0], body, kv_cache_dtype="fp8_e4m3", prefix_cache=False)
    assert pool.k.dtype == torch.float8_e4m3fn
    assert sorted(cached) == [0] + [4 * P] * 7
    assert engine.prefix_cache_stats()["prefill_tokens_computed"] == len(PROMPT) + 7
    leader = cached.index(0)
    followers = [shared[i] for i in range(8) if i != leader]
    assert all(ids == followers[0][0] and torch.equal(lps, followers[0][1]) for ids, lps in followers)
    for ids, lps in shared:
        assert torch.isfinite(lps).all()
        same = [i for i, (a, b) in enumerate(zip(ids, plain[0][0], strict=True)) if a == b]
        assert same[:4] == [0, 1, 2, 3]  # the first tokens before any divergence
        assert (lps[:4] - plain[0][1][:4]).abs().max() < 0.3


def test_the_http_front_flag_and_what_the_engine_refuses(model_dirs):
    args = parse_engine_args(["--model-path", model_dirs[0], "--kv-cache-dtype", "fp8_e5m2"])
    engine = engine_from_args(args)
    assert engine.runner.kv.k.dtype == engine.runner.kv.v.dtype == torch.float8_e5m2
    assert engine.runner.kv.dtype == torch.float32  # what its reads return
    assert parse_engine_args(["--model-path", "m"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_engine_args(["--model-path", "m", "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match=r"--true-on-policy-mode .* kv_cache_dtype='fp8_e4m3'"):
        EmbeddedEngine(model_dirs[0], kv_cache_dtype="fp8_e4m3", true_on_policy=True)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'"):
        EmbeddedEngine(model_dirs[0], kv_cache_dtype="int8")
