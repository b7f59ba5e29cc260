"""An FP8 KV cache on CUDA (bf16 model; CUDA graphs and the Triton kernels on, and off): greedy decoding runs
and its log-probs stay close to the bf16 cache's, scored on the same tokens by prefill."""

import pytest
import torch
from harness import prefill_scorer, with_engine

from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPE = {"hidden": 256, "layers": 3, "heads": 4, "kv_heads": 2, "intermediate": 512}
PROMPT = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return [make_tiny_model(str(root / f"m{seed}"), init_std=0.1, seed=seed, **SHAPE) for seed in (0, 1)]


def _engine_run(path: str, body, **kwargs):
    return with_engine(body, model_path=path, device="cuda", dtype="bfloat16", max_running_requests=8, **kwargs)


async def _greedy(engine) -> tuple[list[int], torch.Tensor, torch.dtype, bool]:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 32}
    out = await engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True)
    lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    return out["output_ids"], lps, engine.runner.kv.k.dtype, engine.runner.fused_kernels


@pytest.mark.parametrize("fused", [True, False], ids=["triton", "eager"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_greedy_decoding_over_an_fp8_cache_on_cuda(model_dirs, kv_cache_dtype, fused):
    ids, lps, stored, fused_on = _engine_run(
        model_dirs[0], _greedy, kv_cache_dtype=kv_cache_dtype, fused_kernels=fused, cuda_graphs=True
    )
    assert stored == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert fused_on == fused and torch.isfinite(lps).all()
    exact = _engine_run(model_dirs[0], prefill_scorer(PROMPT, ids))
    other = _engine_run(model_dirs[1], prefill_scorer(PROMPT, ids))
    gap, model_gap = (lps - exact).abs().mean().item(), (other - exact).abs().mean().item()
    assert gap < model_gap / 10, (gap, model_gap)
