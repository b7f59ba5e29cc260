"""FP8 block quantization (miles/engines/embedded/fp8.py) against hand-computed values and error bounds."""

import pytest
import torch
from harness import cublaslt_scaled_mm

from miles.engines.embedded import fp8


def test_one_block_is_scaled_by_its_amax_over_448_and_round_trips_within_a_sixteenth():
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 3
    q, scale_inv = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (1, 1)
    assert scale_inv.item() == pytest.approx(w.abs().max().item() / 448, rel=1e-7)
    assert q.float().abs().max().item() == 448.0  # the block's largest entry lands on e4m3's largest value
    dq = fp8.dequantize_weight(q, scale_inv)
    err = (dq - w).abs()
    assert (err <= w.abs() / 16 + scale_inv * 2.0**-10).all()  # 3 mantissa bits; subnormal spacing 2^-9
    assert (err <= fp8.error_bound(dq, scale_inv)).all()


def test_blocks_of_a_ragged_matrix_each_get_their_own_scale():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=g)
    w[128:, 256:] *= 1000  # one block far larger than the rest
    q, scale_inv = fp8.quantize_weight(w.to(torch.bfloat16))
    assert q.shape == (200, 300) and scale_inv.shape == (2, 3)
    for i, j in [(0, 0), (1, 2), (0, 2)]:
        block = w.to(torch.bfloat16).float()[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
        assert scale_inv[i, j].item() == pytest.approx(block.abs().max().item() / 448, rel=1e-6)
    dq = fp8.dequantize_weight(q, scale_inv)
    assert ((dq - w.to(torch.bfloat16).float()).abs() <= fp8.error_bound(dq, scale_inv)).all()
    small = (dq - w)[:128, :256].abs().max()
    assert small < 0.5  # the large block's scale did not leak into the others


def test_activation_groups_of_128_round_trip_within_a_sixteenth():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    x[:, :128] *= 100
    q, scale = fp8.quantize_activation(x)
    assert scale.shape == (5, 2)
    assert torch.allclose(scale, x.view(5, 2, 128).abs().amax(-1) / 448)
    dq = (q.float().view(5, 2, 128) * scale[..., None]).view(5, 256)
    assert ((dq - x).abs() <= x.abs() / 16 + scale.repeat_interleave(128, 1) * 2.0**-10).all()


def test_w8a8_linear_is_close_to_the_float_product_and_slices_keep_their_blocks():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(384, 256, generator=g) / 16
    x = torch.randn(7, 256, generator=g)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    got, want = fp8.linear(x, weight), x @ w.t()
    rel = (got - want).norm() / want.norm()
    assert 1e-4 < rel < 0.06  # quantized (not exact), within e4m3's few percent
    part = weight[128:256]
    assert part.scale_inv.shape == (1, 2)
    assert torch.equal(fp8.linear(x, part), got[:, 128:256])
    part.copy_(w[128:256] * 2)  # a push into a slice requantizes only its blocks
    assert torch.allclose(fp8.linear(x, weight)[:, 128:256], 2 * got[:, 128:256], rtol=0.02, atol=0.02)
    assert torch.equal(fp8.linear(x, weight)[:, :128], got[:, :128])


@pytest.mark.parametrize("k", [256, 512, 640])
def test_the_block_scaled_gemm_runs_with_k_padded_to_four_scale_blocks(monkeypatch, k):
    calls = []

    def fake(a, b, scale_a, scale_b, out_dtype):
        calls.append((a.shape, b.shape, scale_a.shape, scale_a.stride(), scale_b.shape, scale_b.stride()))
        return cublaslt_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(fp8, "_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, k, generator=g) * torch.rand(512, 1, generator=g)  # block scales that differ
    x = torch.randn(6, k, generator=g) * torch.rand(6, 1, generator=g) * 4
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    got, want = fp8.linear(x, weight), fp8._emulated(x, weight, torch.float32)
    assert len(calls) == 1 and not fp8._scaled_mm_ok  # cuBLASLt's path ran, nothing was refused
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32 sums in another order
    L4 = -(-(k // fp8.BLOCK) // 4) * 4  # the layout the H200 ran correctly (K = 512): K/128 a multiple of 4
    a, b, sa, sa_stride, sb, sb_stride = calls[0]
    assert a == (8, L4 * 128) and b == (L4 * 128, 512)
    assert sa == (8, L4) and sa_stride == (1, 8) and sb == (L4, 4) and sb_stride == (1, L4)


def test_other_quantization_configs_are_refused_with_the_fix():
    assert fp8.is_fp8_config({}) is False
    assert fp8.is_fp8_config({"quantization_config": dict(fp8.QUANT_CONFIG)}) is True
    with pytest.raises(ValueError, match="miles convert fp8"):
        fp8.is_fp8_config({"quantization_config": {"quant_method": "awq"}})


def test_the_quant_error_check_sends_sketches_not_digests_and_names_a_mismatch():
    import asyncio

    from miles.weights import verify

    class Engine:
        def __init__(self, result: dict):
            self.result, self.calls = result, []

        async def weights_checker(self, **kw):
            self.calls.append(kw)
            return self.result

    sketches: dict = {}
    w = torch.randn(300, 7)
    assert list(verify.sketching([("w", w)], sketches)) == [("w", w)]  # the stream passes through
    idx = verify.sketch_positions("w", w.numel())
    assert sketches["w"] == w.reshape(-1)[idx].tolist() and len(idx) == verify.SKETCH_SIZE
    good, bad = Engine({"mismatched": []}), Engine({"mismatched": ["w"]})
    asyncio.run(verify.check_engines([good], {}, "xxh3-128", sketches=sketches))
    assert good.calls[0]["sketches"] is sketches and "digests" not in good.calls[0]
    with pytest.raises(verify.WeightMismatchError, match="mismatched: w"):
        asyncio.run(verify.check_engines([bad], {}, "xxh3-128", sketches=sketches))


def test_fused_parts_off_block_boundaries_each_own_their_blocks():
    torch.manual_seed(0)
    q, k, v = torch.randn(192, 200), torch.randn(64, 200) * 5, torch.randn(64, 200) * 0.1
    fused = torch.cat([q, k, v])
    parts = [(0, 192), (192, 256), (256, 320)]
    w, starts = fp8.Fp8Weight.from_parts(fused, parts)
    assert starts == [0, 256, 384] and w.q.shape == (512, 200) and w.shape == (320, 200)
    # each part quantizes exactly as on its own: no block mixes rows of two parts (k's scale is not q's)
    for (a, b), start, part in zip(parts, starts, (q, k, v), strict=True):
        alone = fp8.dequantize_weight(*fp8.quantize_weight(part))
        assert torch.equal(w[start : start + b - a].dequantize(), alone)
    x = torch.randn(3, 200)
    out = fp8.linear(x, w)  # the GEMM keeps the projection's 320 outputs, in the fused order
    assert out.shape == (3, 320)
    exact = x @ fused.t()
    for a, b in parts:  # every part within e4m3's few percent of its exact product
        assert (out[:, a:b] - exact[:, a:b]).norm() < 0.05 * exact[:, a:b].norm()
    # a push of one part requantizes its own rows and blocks and leaves the others as they were
    before = w.dequantize()
    w[starts[1] : starts[1] + 64].copy_(k * 2)
    after = w.dequantize()
    assert torch.equal(after[:192], before[:192]) and torch.equal(after[256:], before[256:])
    assert torch.equal(after[192:256], fp8.dequantize_weight(*fp8.quantize_weight(k * 2)))


def test_activations_with_a_partial_last_group_are_quantized_too():
    x = torch.randn(4, 200)
    xq, xs = fp8.quantize_activation(x)
    assert xq.shape == (4, 200) and xs.shape == (4, 2)
    torch.testing.assert_close(xs[:, 1], x[:, 128:].abs().amax(dim=1) / fp8.E4M3_MAX)
    back = xq.float() * xs.repeat_interleave(128, 1)[:, :200]
    assert (back - x).abs().max() <= x.abs().max() / 15


def test_quantize_into_a_weights_own_storage():
    """`out=` (what a push into an engine's weight buffer uses): the same bytes as a fresh quantization,
    written into the given rows of a larger weight and nothing else."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2)) * 0.05
    q_want, s_want = fp8.quantize_weight(w)
    q_all = torch.zeros((384, 300), dtype=fp8.E4M3)
    s_all = torch.full((3, 3), -1.0)
    got = fp8.quantize_weight(w, out=(q_all[128:328], s_all[1:3]))
    assert got[0].data_ptr() == q_all[128:].data_ptr()
    assert torch.equal(q_all[128:328].view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(s_all[1:], s_want)
    assert not q_all[:128].view(torch.uint8).any() and (s_all[0] == -1).all()
    part = fp8.Fp8Weight(q_all, s_all)[128:328]
    part.copy_(w * 2)  # an engine-side push of that part
    assert torch.equal(part.q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(part.scale_inv, s_want * 2)


# ---- a linear's input quantized ahead (fp8.QuantizedInput, what the engine's norm and SiLU kernels hand over)
def _quantized_input(x: torch.Tensor) -> fp8.QuantizedInput:
    """x [M, K] as cuBLASLt takes it, by the torch form: rows padded to 4 with zeros, scales outer-dim-major."""
    pad = (-x.shape[0]) % 4
    xq, xs = fp8.quantize_activation(torch.nn.functional.pad(x, (0, 0, 0, pad)))
    return fp8.QuantizedInput(xq, xs.t().contiguous().t(), x.shape[0], x.dtype)


def _bf16_case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 activation [m, k] and a weight [n, k] whose blocks' scales differ."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return (torch.randn(m, k, generator=g) * 4).to(torch.bfloat16), w


def test_a_quantized_input_gives_the_product_of_the_input_it_was_quantized_from():
    """The emulated path (CPU, and wherever cuBLASLt does not serve): the same codes, so the same bits, through a
    fused projection whose parts are padded to whole blocks (`keep`) and a bias."""
    x, w = _bf16_case(5, 320, 384, seed=7)
    weight, _ = fp8.Fp8Weight.from_parts(w, [(0, 192), (192, 320)])
    bias = torch.randn(320).to(torch.bfloat16)
    want = fp8.linear(x, weight, bias)
    got = fp8.linear(_quantized_input(x), weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 320)
    assert torch.equal(got, want)


@pytest.fixture
def fake_cublaslt(monkeypatch):
    """cuBLASLt's path taken on this CPU (`_hopper` true, torch._scaled_mm as cuBLASLt reads its operands);
    yields the calls' operand shapes and scale strides."""
    calls = []

    def fake(a, b, scale_a, scale_b, out_dtype):
        calls.append((tuple(a.shape), tuple(scale_a.shape), scale_a.stride()))
        return cublaslt_scaled_mm(a, b, scale_a, scale_b, out_dtype)

    monkeypatch.setattr(fp8, "_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    return calls


@pytest.mark.parametrize("k", [256, 512, 640])  # K/128 = 2 and 5: K grown to four blocks (pad_k_blocks)
def test_cublaslts_path_takes_a_quantized_input_as_it_comes(fake_cublaslt, k):
    x, w = _bf16_case(5, 256, k, seed=k)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    want = fp8.linear(x, weight)  # quantized inside linear (the torch form here)
    got = fp8.linear(_quantized_input(x), weight)
    assert len(fake_cublaslt) == 2 and fake_cublaslt[0] == fake_cublaslt[1]  # both on cuBLASLt, same operands
    L4 = -(-(k // fp8.BLOCK) // 4) * 4
    assert fake_cublaslt[1] == ((8, L4 * 128), (8, L4), (1, 8))  # rows padded to 4, scales outer-dim-major
    assert got.shape == (5, 256) and torch.equal(got, want)


def test_a_refused_gemm_reads_the_quantized_input_through_the_emulation(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(fp8, "_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    x, w = _bf16_case(3, 256, 512, seed=1)
    weight = fp8.Fp8Weight(*fp8.quantize_weight(w))
    got = fp8.linear(_quantized_input(x), weight)
    assert fp8._scaled_mm_ok == {(x.device, False): False}  # remembered: no pre-quantized input asked from now on
    assert torch.equal(got, fp8._emulated(x, weight, torch.bfloat16))


CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_hopper(monkeypatch):
    """Everything the fused input quantization needs, on this CPU: FP8 weights that say they live on an H100
    (`cuda:0`, capability 9.0), MILES_FP8_CUDA_KERNELS=1, MILES_FP8_GEMM=cublas, no refusal seen."""
    monkeypatch.setattr(fp8.Fp8Weight, "device", property(lambda self: CUDA0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8, "CUDA_KERNELS", True)
    monkeypatch.setattr(fp8, "GEMM", "cublas")
    monkeypatch.setattr(fp8, "FUSED_INPUT_QUANT", True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    fp8._hopper.cache_clear()
    fp8._triton_gemm.cache_clear()
    yield
    fp8._hopper.cache_clear()
    fp8._triton_gemm.cache_clear()


NO_QUANTIZED_INPUT = {  # each takes one condition away
    "on_the_cpu": lambda mp: mp.setattr(fp8.Fp8Weight, "device", property(lambda self: self.q.device)),
    "kernels_off": lambda mp: mp.setattr(fp8, "CUDA_KERNELS", False),
    "not_hopper": lambda mp: mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9)),
    "triton_gemm_without_e4m3_cores": lambda mp: (
        mp.setattr(fp8, "GEMM", "triton"),
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0)),
    ),
    "refused_before": lambda mp: mp.setitem(fp8._scaled_mm_ok, fp8._mm_key(CUDA0, 384), False),
    "switched_off": lambda mp: mp.setattr(fp8, "FUSED_INPUT_QUANT", False),
}


@pytest.mark.parametrize("condition", list(NO_QUANTIZED_INPUT))
def test_a_quantized_input_is_asked_for_only_where_cublaslt_runs_the_gemm(fake_hopper, monkeypatch, condition):
    weight = fp8.Fp8Weight(*fp8.quantize_weight(torch.randn(256, 384)))
    assert fp8.takes_quantized_input(weight)
    NO_QUANTIZED_INPUT[condition](monkeypatch)
    fp8._hopper.cache_clear()
    fp8._triton_gemm.cache_clear()
    assert not fp8.takes_quantized_input(weight)


@pytest.mark.parametrize(("n", "k", "takes"), [(256, 384, True), (200, 256, True), (256, 320, False)])
def test_the_triton_gemm_asks_for_a_quantized_input_where_k_is_whole_blocks(fake_hopper, monkeypatch, n, k, takes):
    """MILES_FP8_GEMM=triton on a device it serves: its GEMM reads the activation kernel's codes, so a norm or
    SiLU kernel may hand them over; any N, but K in whole 128-blocks (what the activation kernel quantizes)."""
    monkeypatch.setattr(fp8, "GEMM", "triton")
    monkeypatch.setattr(fp8.fp8_triton, "runs_on", lambda device: True)  # Triton's CUDA backend, on this CPU
    assert fp8.takes_quantized_input(fp8.Fp8Weight(*fp8.quantize_weight(torch.randn(n, k)))) is takes
    monkeypatch.setattr(fp8, "FUSED_INPUT_QUANT", False)
    assert not fp8.takes_quantized_input(fp8.Fp8Weight(*fp8.quantize_weight(torch.randn(n, k))))


@pytest.mark.parametrize(("n", "k"), [(256, 320), (200, 256)])  # K, or N, not whole 128-blocks
def test_no_quantized_input_for_shapes_cublaslt_does_not_take_nor_for_a_bf16_weight(fake_hopper, n, k):
    assert not fp8.takes_quantized_input(fp8.Fp8Weight(*fp8.quantize_weight(torch.randn(n, k))))
    assert not fp8.takes_quantized_input(torch.randn(256, 256, dtype=torch.bfloat16))
