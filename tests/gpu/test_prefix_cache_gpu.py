"""Prefix sharing on CUDA (graphs and Triton kernels on): a group of 8 prefills its prompt once and its
fp32 greedy tokens equal the engine's with sharing off."""

import asyncio

import pytest
import torch

from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.prefix_cache import DEFAULT_PAGE_SIZE as P
from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        str(tmp_path_factory.mktemp("tiny") / "qwen2"), hidden=128, layers=3, heads=4, kv_heads=2, intermediate=256
    )


def _group(model_dir: str, prompt: list[int], **kwargs) -> tuple[list[list[int]], dict]:
    async def main():
        engine = EmbeddedEngine(model_dir, device="cuda", dtype="float32", **kwargs)
        await engine.start()
        try:
            params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24, "n": 8}
            outs = await engine.generate(input_ids=prompt, sampling_params=params)
            return [o["output_ids"] for o in outs], engine.prefix_cache_stats()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_a_group_of_8_prefills_once_on_cuda_with_equal_greedy_tokens(model_dir):
    prompt = torch.randint(3, 500, (8 * P + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    shared, stats = _group(model_dir, prompt)
    plain, plain_stats = _group(model_dir, prompt, prefix_cache=False)
    assert shared == plain
    assert stats["prefill_tokens_computed"] == len(prompt) + 7
    assert plain_stats["prefill_tokens_computed"] == 8 * len(prompt)
