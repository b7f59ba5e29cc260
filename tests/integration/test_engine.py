"""Embedded engine against `transformers` on tiny random models (CPU, fp32).

References are computed independently: greedy continuations by HF `generate`, log-probs by a
teacher-forced HF forward pass, concurrency by the same engine serving one request at a time.
"""

import asyncio

import pytest
import torch
from harness import with_engine

from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": make_tiny_model(str(root / "qwen2"), arch="qwen2", init_std=0.2, seed=0),
        "qwen2_new": make_tiny_model(str(root / "qwen2_new"), arch="qwen2", init_std=0.2, seed=1),
        "llama": make_tiny_model(str(root / "llama"), arch="llama", init_std=0.2, seed=0),
        "qwen3_moe": make_tiny_model(str(root / "qwen3_moe"), arch="qwen3_moe", init_std=0.2, seed=0),
    }


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _hf_token_logprobs(hf, ids: list[int], temperature: float) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 from one teacher-forced forward."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def run(engine_kwargs, body):
    """Start an engine, run `body(engine)` on a fresh event loop, shut down."""

    return with_engine(body, **engine_kwargs)


def _prompts(engine, count: int) -> list[list[int]]:
    words = "What is 3+4? The answer is 7. Let us compute 12*5 step by step and check the final sum".split()
    return [engine.tokenizer(" ".join(words[: 2 + i % len(words)]) + f" {i}")["input_ids"] for i in range(count)]


async def _wait_for_tokens(engine, rid: str, count: int) -> None:
    while True:
        reqs = [r for r in [*engine.scheduler.running, *engine.scheduler.waiting] if r.rid == rid]
        if reqs and len(reqs[0].output_ids) >= count:
            return
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])
def test_greedy_matches_transformers_generate(model_dirs, arch):
    hf = _hf(model_dirs[arch])

    async def body(engine):
        prompts = _prompts(engine, 3)
        outs = await asyncio.gather(
            *(engine.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 24}) for p in prompts)
        )
        return prompts, outs

    prompts, outs = run({"model_path": model_dirs[arch]}, body)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == _hf_greedy(hf, prompt, 24)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == 24


def test_sampled_logprobs_equal_teacher_forced_forward(model_dirs):
    hf = _hf(model_dirs["qwen2"])
    temperature = 0.7

    async def body(engine):
        prompts = _prompts(engine, 4)
        params = {
            "temperature": temperature,
            "top_p": 0.9,
            "max_new_tokens": 20,
            "ignore_eos": True,
            "sampling_seed": 5,
        }
        return prompts, await asyncio.gather(
            *(
                engine.generate(input_ids=p, sampling_params=params, return_logprob=True, logprob_start_len=0)
                for p in prompts
            )
        )

    prompts, outs = run({"model_path": model_dirs["qwen2"]}, body)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_token_logprobs(hf, prompt + out["output_ids"], temperature)
        got_out = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        assert max(abs(a - b) for a, b in zip(got_out, ref[len(prompt) - 1 :], strict=True)) <= 1e-5
        got_in = out["meta_info"]["input_token_logprobs"]
        assert got_in[0][0] is None and [t for _, t, _ in got_in] == prompt
        assert max(abs(a[0] - b) for a, b in zip(got_in[1:], ref[: len(prompt) - 1], strict=True)) <= 1e-5


def test_prefill_only_scoring_call(model_dirs):
    hf = _hf(model_dirs["qwen2"])

    async def body(engine):
        prompt = _prompts(engine, 6)[5]
        out = await engine.generate(
            input_ids=prompt,
            sampling_params={"max_new_tokens": 0, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=2,
        )
        return prompt, out

    prompt, out = run({"model_path": model_dirs["qwen2"]}, body)
    ref = _hf_token_logprobs(hf, prompt, 1.0)
    got = out["meta_info"]["input_token_logprobs"]
    assert out["output_ids"] == [] and [t for _, t, _ in got] == prompt[2:]
    assert max(abs(a[0] - b) for a, b in zip(got, ref[1:], strict=True)) <= 1e-5


def test_64_concurrent_requests_match_one_at_a_time(model_dirs):
    async def body(engine):
        prompts = _prompts(engine, 64)
        params = [
            {"temperature": 0.0 if i % 2 else 0.9, "max_new_tokens": 4 + i % 13, "ignore_eos": True} for i in range(64)
        ]
        together = await asyncio.gather(
            *(
                engine.generate(input_ids=p, sampling_params=sp, rid=f"r{i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            )
        )
        alone = [
            await engine.generate(input_ids=p, sampling_params=sp, rid=f"r{i}")
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        return params, together, alone

    params, together, alone = run(
        {"model_path": model_dirs["qwen2"], "deterministic": True, "max_running_requests": 64}, body
    )
    for sp, a, b in zip(params, together, alone, strict=True):
        assert len(a["output_ids"]) == sp["max_new_tokens"]
        assert a["output_ids"] == b["output_ids"]


def test_abort_mid_flight_returns_partial_output(model_dirs):
    async def body(engine):
        prompt = _prompts(engine, 1)[0]
        task = asyncio.create_task(
            engine.generate(input_ids=prompt, rid="long", sampling_params={**GREEDY, "max_new_tokens": 3000})
        )
        other = asyncio.create_task(engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8}))
        await _wait_for_tokens(engine, "long", 5)
        engine.abort("long")
        out = await task
        return (
            prompt,
            out,
            await other,
            await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 20}),
        )

    prompt, out, other, full = run({"model_path": model_dirs["qwen2"]}, body)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(out["output_ids"])
    assert 5 <= n < 3000
    assert out["output_ids"][:20] == full["output_ids"][: min(n, 20)]
    assert other["meta_info"]["finish_reason"]["type"] == "length"  # its neighbour was not disturbed


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_new_weights_continue_uses_new_weights(model_dirs, mode):
    new_hf = _hf(model_dirs["qwen2_new"])

    async def body(engine):
        prompt = _prompts(engine, 3)[2]
        task = asyncio.create_task(engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 30}))
        while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 6:
            await asyncio.sleep(0.001)
        await engine.pause_generation(mode)
        engine.load_weights_from_dir(model_dirs["qwen2_new"])
        engine.weight_version = 1
        await engine.continue_generation()
        return prompt, await task

    prompt, out = run({"model_path": model_dirs["qwen2"]}, body)
    versions = out["meta_info"]["output_token_weight_versions"]
    k = versions.index(1)
    assert k >= 6 and versions == [0] * k + [1] * (30 - k)
    # tokens after the pause continue prompt + tokens-before-pause greedily under the new weights
    assert out["output_ids"][k:] == _hf_greedy(new_hf, prompt + out["output_ids"][:k], 30 - k)
    assert out["meta_info"]["weight_version"] == "1"


def test_pause_abort_finishes_running_requests(model_dirs):
    async def body(engine):
        prompt = _prompts(engine, 1)[0]
        task = asyncio.create_task(
            engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 3000})
        )
        while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 3:
            await asyncio.sleep(0.001)
        await engine.pause_generation("abort")
        out = await task
        await engine.continue_generation()
        after = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 4})
        return out, after

    out, after = run({"model_path": model_dirs["qwen2"]}, body)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) >= 3
    assert len(after["output_ids"]) == 4


def test_n_samples_and_seeds(model_dirs):
    async def body(engine):
        prompt = _prompts(engine, 1)[0]
        params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "n": 4, "sampling_seed": 7}
        return (
            await engine.generate(input_ids=prompt, sampling_params=params, rid="g"),
            await engine.generate(input_ids=prompt, sampling_params=params, rid="h"),
        )

    first, second = run({"model_path": model_dirs["qwen2"]}, body)
    assert isinstance(first, list) and len(first) == 4
    assert len({tuple(o["output_ids"]) for o in first}) > 1  # the n samples differ
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in second]  # same seed, same samples
    assert [o["meta_info"]["id"] for o in first] == ["g-0", "g-1", "g-2", "g-3"]


def test_stop_strings_and_stop_token_ids(model_dirs):
    async def body(engine):
        prompt = _prompts(engine, 2)[1]
        free = await engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16})
        ids = free["output_ids"]
        stop_tok = ids[5]
        # a stop string taken from the text of tokens 6..8, so it first appears at or after token 6
        stop_str = engine.tokenizer.decode(ids[6:9])
        by_str = await engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16, "stop": [stop_str]}
        )
        by_tok = await engine.generate(
            input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16, "stop_token_ids": [stop_tok]}
        )
        return free, stop_str, stop_tok, by_str, by_tok

    free, stop_str, stop_tok, by_str, by_tok = run({"model_path": model_dirs["qwen2"]}, body)
    full_text = free["text"]
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert by_str["text"] == full_text[: full_text.index(stop_str)]
    assert by_str["output_ids"] == free["output_ids"][: len(by_str["output_ids"])]
    assert len(by_str["output_ids"]) <= 9
    first = free["output_ids"].index(stop_tok)
    assert by_tok["output_ids"] == free["output_ids"][: first + 1]
    assert by_tok["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


def test_load_weights_validates_and_named_weights_round_trip(model_dirs):
    engine = EmbeddedEngine(model_dirs["qwen2"])
    named = dict(engine.named_weights())
    assert "model.layers.0.self_attn.q_proj.bias" in named
    with pytest.raises(ValueError, match="unknown weight 'model.nope'"):
        engine.load_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch for 'model.norm.weight'"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    new = torch.full_like(named["model.norm.weight"], 0.5)
    engine.load_weights([("model.norm.weight", new), ("lm_head.weight", named["model.embed_tokens.weight"] * 2)])
    assert torch.equal(dict(engine.named_weights())["model.norm.weight"], new)
    engine.release_memory_occupation()  # CPU: nothing moves, but the call is accepted
    engine.resume_memory_occupation()
    assert engine.model_info()["weight_version"] == "0" and engine.flush_cache()


def test_shutdown_finishes_in_flight_requests(model_dirs):
    async def main():
        engine = EmbeddedEngine(model_dirs["qwen2"])
        await engine.start()
        task = asyncio.create_task(
            engine.generate(input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 3000})
        )
        while not engine.scheduler.running or len(engine.scheduler.running[0].output_ids) < 2:
            await asyncio.sleep(0.001)
        await engine.shutdown()
        return await asyncio.wait_for(task, timeout=10)

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) >= 2


def test_a_cpu_cache_sized_by_default_fits_a_share_of_the_memory(model_dirs, monkeypatch, caplog):
    from types import SimpleNamespace

    import psutil

    from miles.engines.embedded import engine_setup as engine_mod

    assert EmbeddedEngine(model_dirs["qwen2"], max_running_requests=4).max_seq_len > 256  # plenty: the default
    spec = EmbeddedEngine(model_dirs["qwen2"], max_total_tokens=64, max_running_requests=4).model.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # fp32
    available = int(4 * per_token * 100 / engine_mod.CPU_KV_MEMORY_FRACTION)  # 100 tokens for each of 4 slots
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=available, total=1 << 36))
    with caplog.at_level("WARNING", logger=engine_mod.__name__):
        small = EmbeddedEngine(model_dirs["qwen2"], max_running_requests=4)
    assert small.max_seq_len == 100 and "--max-total-tokens" in caplog.text
    chosen = EmbeddedEngine(model_dirs["qwen2"], max_running_requests=4, max_total_tokens=4 * 512)
    assert chosen.max_seq_len == 512  # an explicit size is the user's
