"""Teacher scoring over HTTP: the embedded engine's top-K / token-id log-probs and the OPD teacher scorer.

References are independent: a teacher-forced `transformers` forward (float64 log-softmax at the
temperature) gives every log-prob, top-K set and per-id value the engine must return, and the
teacher's log-probs the scorer must store; routing is checked with two teachers of different weights.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
import torch

from miles.algo.opd import topk_reverse_kl
from miles.engines.client import EngineClient
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.http_front import start_http_server
from miles.models.tiny import make_tiny_model
from miles.rollout.generate import SamplingDefaults, generate_sample
from miles.rollout.opd_teacher import STUDENT_TOP_KEY, TeacherRoutingError, TeacherScorer
from miles.rollout.sample import Sample

torch.set_num_threads(1)
T = 0.7
K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    return {
        name: make_tiny_model(str(root / name), arch="qwen2", init_std=0.2, seed=seed)
        for name, seed in (("student", 0), ("math", 1), ("default", 2))
    }


def hf_rows(path: str, ids: list[int]) -> torch.Tensor:
    """float64 log_softmax(logits / T) of a teacher-forced forward: row i predicts ids[i + 1]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / T, dim=-1)


async def serve(stack: AsyncExitStack, path: str) -> EngineClient:
    engine = EmbeddedEngine(path)
    await engine.start()
    stack.push_async_callback(engine.shutdown)
    handle = await start_http_server(engine, "127.0.0.1", 0)
    stack.push_async_callback(handle.stop)
    client = EngineClient(handle.url, timeout_s=60, max_retries=0)
    stack.push_async_callback(client.close)
    return client


def assert_entries(got: list, rows: torch.Tensor, want_ids: list[list[int]]) -> None:
    """Each position's [logprob, id, None] entries carry the ids `want_ids` with the reference's values."""
    assert [[e[1] for e in pos] for pos in got] == want_ids
    for pos, row in zip(got, rows, strict=True):
        assert [e[0] for e in pos] == pytest.approx([row[e[1]].item() for e in pos], abs=1e-4)


def test_engine_returns_top_k_and_token_id_log_probs(models):
    async def main():
        async with AsyncExitStack() as stack:
            client = await serve(stack, models["student"])
            params = {"temperature": T, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 7}
            out = await client.generate(
                {
                    "input_ids": [5, 6, 7],
                    "sampling_params": params,
                    "return_logprob": True,
                    "top_logprobs_num": K,
                    "token_ids_logprob": [3, 9],
                }
            )
            ids = [5, 6, 7, *out["output_ids"]]
            scored = await client.generate(
                {
                    "input_ids": ids,
                    "sampling_params": {"temperature": T, "max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "top_logprobs_num": K,
                    "token_ids_logprob": [3, 9],
                    "return_text_in_logprobs": True,
                }
            )
            return ids, out["meta_info"], scored["meta_info"]

    ids, gen, score = asyncio.run(main())
    rows = hf_rows(models["student"], ids)
    out_rows = rows[2:-1]  # the distributions the 5 output tokens were sampled from
    assert_entries(gen["output_top_logprobs"], out_rows, out_rows.topk(K).indices.tolist())
    assert_entries(gen["output_token_ids_logprobs"], out_rows, [[3, 9]] * 5)
    # prefill-only, from position 0: position 0 predicts nothing (an empty list), position i reads row i - 1
    assert score["input_top_logprobs"][0] == [] and len(score["input_top_logprobs"]) == len(ids)
    assert_entries(score["input_top_logprobs"][1:], rows[:-1], rows[:-1].topk(K).indices.tolist())
    assert_entries(score["input_token_ids_logprobs"][1:], rows[:-1], [[3, 9]] * (len(ids) - 1))
    assert all(isinstance(e[2], str) for pos in score["input_top_logprobs"] for e in pos)


def student_sample(index: int, metadata: dict) -> Sample:
    return Sample(prompt="", tokens=[5 + index, 6, 7], metadata=metadata, index=index, group_index=index)


async def sampled(client: EngineClient, samples: list[Sample], top_k: int = 0) -> None:
    sampling = SamplingDefaults(temperature=T, max_new_tokens=6, top_logprobs_num=top_k)
    for i, s in enumerate(samples):
        await generate_sample(client, s, tokenizer=None, sampling=sampling, seed=100 + i)


def test_each_sample_is_scored_by_the_teacher_its_prompt_names(models):
    samples = [
        student_sample(0, {"opd_teacher": "math"}),
        student_sample(1, {"opd_teacher": "code"}),
        student_sample(2, {}),
    ]

    async def main():
        async with AsyncExitStack() as stack:
            student = await serve(stack, models["student"])
            teachers = {name: await serve(stack, models[name]) for name in ("math", "default")}
            await sampled(student, samples)
            scorer = TeacherScorer(teachers, key="opd_teacher", temperature=T)
            for s in samples:
                await scorer.score(s)
            lonely = TeacherScorer({"math": teachers["math"]}, key="opd_teacher", temperature=T)
            with pytest.raises(TeacherRoutingError, match="names the teacher 'code'"):
                await lonely.score(samples[1])
            return scorer.pop_metrics()

    metrics = asyncio.run(main())
    for s, teacher in zip(samples, ("math", "default", "default"), strict=True):
        rows = hf_rows(models[teacher], s.tokens)
        want = [rows[i - 1, s.tokens[i]].item() for i in range(s.prompt_length, len(s.tokens))]
        assert s.teacher_log_probs == pytest.approx(want, abs=1e-4)
        other = hf_rows(models["math" if teacher == "default" else "default"], s.tokens)
        assert s.teacher_log_probs != pytest.approx(
            [other[i - 1, s.tokens[i]].item() for i in range(s.prompt_length, len(s.tokens))], abs=1e-3
        )
    assert metrics["rollout/opd_teacher_samples/math"] == 1 and metrics["rollout/opd_teacher_samples/default"] == 2


@pytest.mark.parametrize("strategy", ["only-student", "only-teacher", "union"])
def test_top_k_estimate_from_the_engines_equals_the_estimate_from_reference_distributions(models, strategy):
    sample = student_sample(0, {})

    async def main():
        async with AsyncExitStack() as stack:
            student = await serve(stack, models["student"])
            teacher = await serve(stack, models["default"])
            await sampled(student, [sample], top_k=K)
            scorer = TeacherScorer(
                {"default": teacher},
                key="opd_teacher",
                temperature=T,
                top_k=K,
                strategy=strategy,
                weight_mode="teacher_p",
                student=student,
            )
            await scorer.score(sample)

    asyncio.run(main())
    p, n = sample.prompt_length, sample.response_length
    s_rows, t_rows = (
        hf_rows(models["student"], sample.tokens)[p - 1 : -1],
        hf_rows(models["default"], sample.tokens)[p - 1 : -1],
    )
    full = [{t: row[t].item() for t in range(row.shape[0])} for row in s_rows]
    teacher_full = [{t: row[t].item() for t in range(row.shape[0])} for row in t_rows]
    s_top = [{t: row[t].item() for t in row.topk(K).indices.tolist()} for row in s_rows]
    t_top = [{t: row[t].item() for t in row.topk(K).indices.tolist()} for row in t_rows]
    want = topk_reverse_kl(s_top, t_top, teacher_full, full, strategy, "teacher_p")
    assert len(sample.metadata[STUDENT_TOP_KEY]) == n
    assert sample.opd_reverse_kl == pytest.approx(want, abs=1e-4)
