"""FP8 on Hopper: the block-scaled torch._scaled_mm path agrees with the dequantizing emulation, and an FP8
engine (CUDA graphs) scores close to its bf16 source, with the forward's CUDA kernels (Triton activation
quantization, cuBLASLt's block-scaled GEMM: fp8.CUDA_KERNELS) on, as by default, and switched off. Weights
are quantized by the Triton kernel on CUDA either way. With the kernels on, the norm and SiLU kernels hand
cuBLASLt its inputs quantized (fp8.FUSED_INPUT_QUANT): the same codes as the activation kernel's, so the same
scores as with that switched off."""

import asyncio

import pytest
import torch

from miles.engines.embedded import fp8, fp8_triton, triton_ops
from miles.engines.embedded.engine import EmbeddedEngine
from miles.engines.embedded.fp8_checkpoint import write_fp8_checkpoint
from miles.models.tiny import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs Hopper"
)


@pytest.fixture
def kernels_on(monkeypatch):
    """fp8.CUDA_KERNELS on for one test, with torch._scaled_mm's calls counted and no refusal remembered."""
    calls = []
    scaled_mm = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(kwargs["scale_b"].shape)
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(fp8, "CUDA_KERNELS", True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    fp8._hopper.cache_clear()
    yield calls
    fp8._hopper.cache_clear()


@hopper
@pytest.mark.parametrize("k", [256, 512, 640])  # K/128 = 2, 4, 5: K padded to 4 scale blocks or not
@pytest.mark.parametrize("m", [1, 3, 256])
def test_block_scaled_mm_matches_the_emulation_on_hopper(kernels_on, m, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.rand(1024, 1, device="cuda", generator=g) + 0.05  # block scales that differ
    w = (torch.randn(1024, k, device="cuda", generator=g) * rows / 20).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))  # the Triton kernel
    got = fp8.linear(x, weight)
    assert not fp8._scaled_mm_ok, "torch._scaled_mm refused the 1x128 / 128x128 block scaling"
    assert len(kernels_on) == 1
    want = fp8._emulated(x, weight, torch.float32)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def _score(path: str, ids: list[int]) -> tuple[torch.Tensor, dict]:
    """Log-probs of ids[1:] (prefill) and a 16-token greedy decode of ids[:8] (CUDA graphs)."""

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


# hidden 256: q/k/v/o and gate/up have K/128 = 2 (weight scales padded for cuBLASLt), down 4. With one KV head,
# k and v are 64 rows and gate/up 320: fused parts laid out from block boundaries (the GEMM keeps the real
# outputs), and the down projection's K = 320 takes the dequantizing path.
SHAPES = {"whole_blocks": {"kv_heads": 2, "intermediate": 512}, "partial_blocks": {"kv_heads": 1, "intermediate": 320}}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoints(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_gpu")
    src = make_tiny_model(str(root / "bf16"), hidden=256, layers=2, heads=4, init_std=0.02, **SHAPES[request.param])
    ids = torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return src, write_fp8_checkpoint(src, str(root / "fp8")), ids


def test_an_fp8_engine_on_cuda_scores_close_to_bf16(checkpoints):
    src, dst, ids = checkpoints
    lp8, greedy8 = _score(dst, ids)
    lp16, _ = _score(src, ids)
    assert (lp8 - lp16).abs().mean().item() < 0.1
    assert len(greedy8["output_ids"]) == 16


@hopper
def test_the_fp8_cuda_kernels_score_as_the_dequantizing_path(checkpoints, kernels_on):
    src, dst, ids = checkpoints
    lp_kernels, greedy_kernels = _score(dst, ids)
    assert kernels_on and not fp8._scaled_mm_ok, f"cuBLASLt's path did not run ({len(kernels_on)} calls)"
    fp8._hopper.cache_clear()
    fp8.CUDA_KERNELS = False  # the fixture's monkeypatch restores it
    lp_dequant, greedy_dequant = _score(dst, ids)
    lp16, _ = _score(src, ids)
    gap, to_bf16 = (lp_kernels - lp_dequant).abs().mean().item(), (lp_kernels - lp16).abs().mean().item()
    print(f"fp8 kernels vs dequantizing path: {gap:.4f} nats (mean); vs bf16: {to_bf16:.4f}")
    assert gap < 0.02 and to_bf16 < 0.1, (gap, to_bf16)
    assert len(greedy_kernels["output_ids"]) == 16


@hopper
def test_the_fused_input_quantization_scores_as_the_separate_kernel(checkpoints, kernels_on, monkeypatch):
    """The norms and SiLU quantize for cuBLASLt (CUDA graphs: the decode step captured with them): the same greedy
    tokens and the same log-probs, bit for bit, as with each GEMM quantizing its input in its own kernel."""
    _, dst, ids = checkpoints
    quantized_inputs = []
    linear = fp8.linear

    def recorded(x, w, bias=None):
        quantized_inputs.append(isinstance(x, fp8.QuantizedInput))
        return linear(x, w, bias)

    monkeypatch.setattr(fp8, "linear", recorded)
    lp_fused, greedy_fused = _score(dst, ids)
    assert any(quantized_inputs) and not fp8._scaled_mm_ok, "no GEMM took a quantized input on cuBLASLt"
    quantized_inputs.clear()
    monkeypatch.setattr(fp8, "FUSED_INPUT_QUANT", False)
    lp_separate, greedy_separate = _score(dst, ids)
    assert quantized_inputs and not any(quantized_inputs)
    assert greedy_fused["output_ids"] == greedy_separate["output_ids"]
    assert torch.equal(lp_fused, lp_separate), (lp_fused - lp_separate).abs().max().item()


@pytest.mark.parametrize(("rows", "hidden", "intermediate"), [(3, 256, 512), (256, 3584, 18944)])  # tiny; 7B
def test_the_norm_and_silu_kernels_quantize_as_the_activation_kernel_on_cuda(rows, hidden, intermediate):
    """Codes and scales bit-equal to quantize_activation(output, pad_to=4) of the bf16 output the kernels would
    have stored (Triton's fp32 division on the GPU is not IEEE's, but it is the same instruction in both)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    stream = torch.randn(rows, hidden, device="cuda", generator=g)  # the fp32 residual stream
    weight = torch.randn(hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    gate_up = torch.randn(rows, 2 * intermediate, device="cuda", generator=g, dtype=torch.bfloat16)
    stream_fused = stream.clone()
    norm_fused = triton_ops.add_rms_norm(x, stream_fused, weight, 1e-6, quantize=True)
    norm = triton_ops.add_rms_norm(x, stream, weight, 1e-6)
    pairs = [(norm_fused, norm), (triton_ops.silu_mul(gate_up, quantize=True), triton_ops.silu_mul(gate_up))]
    assert torch.equal(stream_fused, stream)
    for got, output in pairs:
        q, scales = fp8_triton.quantize_activation(output, pad_to=4)
        assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got.scales, scales) and got.scales.stride() == scales.stride()


def _captured(fn):
    """fn's output recomputed by a CUDA graph captured after two eager warm-ups, as the engine's runner does."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@hopper
@pytest.mark.parametrize("piece", ["quantize_activation", "linear", "quantizing_norm_then_linear"])
@pytest.mark.parametrize("k", [256, 512])
def test_the_fp8_kernels_capture_in_a_cuda_graph(kernels_on, piece, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(1024, k, device="cuda", generator=g) / 20).to(torch.bfloat16)
    x = torch.randn(256, k, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    norm = torch.randn(k, device="cuda", generator=g, dtype=torch.bfloat16)
    pieces = {
        "quantize_activation": lambda: fp8_triton.quantize_activation(x, pad_to=4)[1],
        "linear": lambda: fp8.linear(x, weight),
        "quantizing_norm_then_linear": lambda: fp8.linear(
            triton_ops.add_rms_norm(x, None, norm, 1e-6, quantize=True), weight
        ),
    }
    fn = pieces[piece]
    eager = fn().clone()
    assert torch.equal(_captured(fn), eager)


@pytest.fixture
def triton_gemm(monkeypatch, kernels_on):
    """The forward's kernels on with the Triton block-scaled GEMM (MILES_FP8_GEMM=triton) instead of cuBLASLt's."""
    monkeypatch.setattr(fp8, "GEMM", "triton")
    fp8._triton_gemm.cache_clear()
    yield kernels_on
    fp8._triton_gemm.cache_clear()


fp8_cores = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs e4m3 tensor cores"
)


@fp8_cores
@pytest.mark.parametrize("k", [256, 640, 896])  # K/128 = 2, 5, 7: no padding to four blocks on this path
@pytest.mark.parametrize("m", [1, 3, 256])
def test_the_triton_gemm_matches_the_emulation(triton_gemm, m, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.rand(1000, 1, device="cuda", generator=g) + 0.05  # block scales that differ; N not whole blocks
    w = (torch.randn(1000, k, device="cuda", generator=g) * rows / 20).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    got = fp8.linear(x, weight)
    assert not triton_gemm, "cuBLASLt ran instead of the Triton GEMM"
    want = fp8._emulated(x, weight, torch.float32)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


@fp8_cores
def test_the_triton_gemm_scores_as_the_dequantizing_path_and_captures(checkpoints, triton_gemm):
    src, dst, ids = checkpoints
    lp_triton, greedy = _score(dst, ids)  # CUDA graphs: the GEMM inside the captured decode step
    assert not triton_gemm, "cuBLASLt ran instead of the Triton GEMM"
    fp8._triton_gemm.cache_clear()
    fp8.CUDA_KERNELS = False  # the fixtures' monkeypatch restores it
    lp_dequant, _ = _score(dst, ids)
    gap = (lp_triton - lp_dequant).abs().mean().item()
    print(f"fp8 Triton GEMM vs dequantizing path: {gap:.4f} nats (mean)")
    assert gap < 0.02, gap
    assert len(greedy["output_ids"]) == 16


@hopper
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("m", [3, 256])
def test_a_split_k_gemm_matches_the_whole_one_and_captures(kernels_on, monkeypatch, splits, m):
    """fp8_split_k on cuBLASLt: each chunk taken (no refusal), the sum within bf16 rounding of the whole GEMM's,
    and the chunks' streams captured into a CUDA graph that recomputes the eager output bit for bit."""
    monkeypatch.setattr(fp8, "_split_ok", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.rand(1024, 1, device="cuda", generator=g) + 0.05
    w = (torch.randn(1024, 4096, device="cuda", generator=g) * rows / 20).to(torch.bfloat16)  # 8 groups of 4 blocks
    x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    whole = fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=0)
    kernels_on.clear()
    split = fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=splits)
    assert not fp8._split_ok and not fp8._scaled_mm_ok, "torch._scaled_mm refused a chunk"
    assert len(kernels_on) == splits
    torch.testing.assert_close(split.float(), whole.float(), rtol=2**-7, atol=2**-7 * whole.abs().max().item())
    assert torch.equal(_captured(lambda: fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=splits)), split)


@hopper
def test_an_engine_with_split_k_gemms_scores_as_with_whole_ones(tmp_path, kernels_on, monkeypatch):
    """MILES_FP8_SPLIT_K=2 on a model whose down projection has K = 1024 (two groups of four blocks): the split
    GEMMs run in the prefill and in the captured decode graphs, and the log-probs stay within fp32-order noise."""
    from miles.engines.embedded import fp8_split_k

    src = make_tiny_model(str(tmp_path / "bf16"), hidden=256, layers=2, heads=4, kv_heads=2, intermediate=1024)
    dst = write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    ids = torch.randint(3, 200, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    split_calls = []
    split_k_mm = fp8_split_k.split_k_mm

    def counted(*args, **kwargs):
        split_calls.append(args[-1])
        return split_k_mm(*args, **kwargs)

    monkeypatch.setattr(fp8_split_k, "split_k_mm", counted)
    monkeypatch.setattr(fp8, "_split_ok", {})
    monkeypatch.setattr(fp8_split_k, "SPLIT_K", 2)
    lp_split, greedy_split = _score(dst, ids)
    assert split_calls and set(split_calls) == {2} and not fp8._split_ok
    monkeypatch.setattr(fp8_split_k, "SPLIT_K", 0)
    lp_whole, greedy_whole = _score(dst, ids)
    gap = (lp_split - lp_whole).abs().max().item()
    print(f"split-K vs whole GEMMs: {gap:.2e} nats (max); greedy equal: {greedy_split == greedy_whole}")
    assert gap < 1e-2


def _decode(path: str, ids: list[int]) -> tuple[list[int], list[float], list[float]]:
    """A 24-token greedy decode (CUDA graphs) of ids: its tokens, their log-probs, and the same tokens' log-probs
    scored by a prefill of ids + tokens (teacher-forced, through the prefill's own kernels)."""

    async def main():
        engine = EmbeddedEngine(path, device="cuda", dtype="bfloat16")
        await engine.start()
        try:
            params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
            out = await engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
            tokens = out["output_ids"]
            scored = await engine.generate(
                input_ids=ids + tokens, sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                return_logprob=True, logprob_start_len=0,
            )  # fmt: skip
            prefill = [lp for lp, _, _ in scored["meta_info"]["input_token_logprobs"][len(ids) :]]
            return tokens, [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], prefill
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@hopper
def test_the_decode_attention_adds_the_qkv_bias_the_fp8_gemm_left_out(tmp_path, kernels_on, monkeypatch):
    """Non-zero q/k/v biases: in the captured decode step the FP8 qkv GEMM runs without its bias and the attention
    kernel adds it; the prefill (where `linear` adds it) scores the decoded tokens alike, which a bias left out
    (0.5 a channel) would not."""
    from safetensors.torch import load_file, save_file

    src = make_tiny_model(str(tmp_path / "bf16"), hidden=256, layers=2, heads=2, kv_heads=1, intermediate=512,
                          init_std=0.02)  # fmt: skip
    weights = load_file(f"{src}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    biases = [name for name in weights if name.endswith("proj.bias")]
    assert biases, "the tiny qwen2 has no q/k/v biases"
    for name in biases:
        weights[name] = (torch.randn(weights[name].shape, generator=g) * 0.5).to(weights[name].dtype)
    save_file(weights, f"{src}/model.safetensors", metadata={"format": "pt"})
    dst = write_fp8_checkpoint(src, str(tmp_path / "fp8"))
    ids = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    rope_attend = triton_ops.DecodeAttention.rope_attend

    def recorded(self, *args, **kwargs):
        calls.append(kwargs.get("bias") is not None)
        return rope_attend(self, *args, **kwargs)

    monkeypatch.setattr(triton_ops.DecodeAttention, "rope_attend", recorded)
    tokens, logprobs, prefill = _decode(dst, ids)
    assert calls and all(calls), calls
    gap = (torch.tensor(logprobs) - torch.tensor(prefill)).abs().max().item()
    print(f"fp8 decode vs its prefill's scores of the same {len(tokens)} tokens: {gap:.2e} nats (max)")
    assert gap < 0.02
