"""FP8 on Hopper: the block-scaled torch._scaled_mm path agrees with the dequantizing emulation, and an FP8
engine (CUDA graphs, Triton kernels) scores close to its bf16 source."""

import asyncio

import pytest
import torch

from miles.engines.embedded import fp8
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.fp8_checkpoint import write_fp8_checkpoint
from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs Hopper")
@pytest.mark.parametrize("m", [1, 3, 256])
def test_block_scaled_mm_matches_the_emulation_on_hopper(m):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 512, device="cuda", generator=g, dtype=torch.bfloat16) / 20
    x = torch.randn(m, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    got = fp8.linear(x, weight)
    assert fp8._scaled_mm_ok.get(x.device, True), "torch._scaled_mm refused the 1x128 / 128x128 block scaling"
    want = fp8._emulated(x, weight, torch.float32)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_an_fp8_engine_on_cuda_scores_close_to_bf16(tmp_path):
    src = make_tiny_model(
        str(tmp_path / "bf16"), hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, init_std=0.02
    )
    dst = write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    ids = torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(0)).tolist()

    def score(path):
        async def main():
            engine = EmbeddedEngine(path, device="cuda", dtype="bfloat16")
            await engine.start()
            try:
                params = {"max_new_tokens": 0, "temperature": 1.0}
                out = await engine.generate(
                    input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0
                )
                greedy = await engine.generate(
                    input_ids=ids[:8], sampling_params={"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
                )
                return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]), greedy
            finally:
                await engine.shutdown()

        return asyncio.run(main())

    lp8, greedy8 = score(dst)
    lp16, _ = score(src)
    assert (lp8 - lp16).abs().mean().item() < 0.1
    assert len(greedy8["output_ids"]) == 16
