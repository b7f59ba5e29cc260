"""MoE on CUDA: the engine's grouped Triton experts give transformers' greedy tokens (fp32), the kernels replay
under a CUDA graph, and bench/moe.py's figures hold at a small size (R3: zero routing mismatch)."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from miles.engines.embedded import moe, moe_triton
from miles.engines.embedded.engine import EmbeddedEngine
from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))


def test_fp32_greedy_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe", layers=3, hidden=128, init_std=0.2)
    prompts = [[5, 17, 42, 9, 3], [7, 7, 100, 2, 64, 31, 8, 11]]
    engine = EmbeddedEngine(model_path=path, device="cuda", dtype="float32")

    async def main():
        await engine.start()
        try:
            params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
            return await asyncio.gather(*(engine.generate(input_ids=p, sampling_params=params) for p in prompts))
        finally:
            await engine.shutdown()

    outs = asyncio.run(main())
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for p, out in zip(prompts, outs, strict=True):
        want = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out["output_ids"] == want[0, len(p) :].tolist()


def test_grouped_experts_replay_under_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k, e, d, inter = 64, 8, 32, 256, 128
    x = torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    gate_up = torch.randn(e, 2 * inter, d, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    down = torch.randn(e, d, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    router = torch.randn(e, d, device="cuda", generator=g, dtype=torch.bfloat16)
    eager = moe.experts_loop(x, *moe.route(x, router, k, True), gate_up, down)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_triton.fused_experts(x, *moe.route(x, router, k, True), gate_up, down)  # compile outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.fused_experts(x, *moe.route(x, router, k, True), gate_up, down)
    x.copy_(torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16))  # new tokens, new routing
    graph.replay()
    want = moe.experts_loop(x, *moe.route(x, router, k, True), gate_up, down)
    torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert not torch.equal(out, eager)


def test_bench_figures_at_a_small_size():
    from bench_modules import load_bench

    bench = load_bench("moe")
    args = bench.parse("--layers 4 --hidden 512 --heads 8 --kv-heads 2 --experts 64 --topk 8 --moe-intermediate 256 "
                       "--batch 64 --context 128 --reps 3".split())  # fmt: skip
    figures = bench.run(args)
    assert figures["mismatch"]["on"]["routing_mismatch"] == 0.0
    assert figures["decode_speedup"] > 1.0
