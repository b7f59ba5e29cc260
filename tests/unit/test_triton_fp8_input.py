"""The norm and SiLU kernels' quantized outputs (triton_ops `quantize=True`) against the kernels they replace.

A kernel asked to quantize stores, instead of its model-dtype output, the e4m3 codes and scales that
`fp8_triton.quantize_activation(output, pad_to=4)` gives for that output: bit for bit, pad rows and scale
layout included, so the FP8 GEMM reading them computes what it computed from the separate quantization. The
fused decode and prefill hand such inputs to the qkv, gate/up and down GEMMs where cuBLASLt runs them (faked
here: `_hopper` true and torch._scaled_mm computed as cuBLASLt reads its operands), with the same hidden states.

On a CUDA machine the checks run on the GPU; elsewhere in a child process under Triton's interpreter (as in
test_triton_ops.py), whose fp32 -> bf16 and -> e4m3 conversions are made to round to nearest even as the GPU's
do (`gpu_rounding`); there the codes are also checked against the torch form of the quantization.
"""

from __future__ import annotations

import pytest
import torch
from harness import cublaslt_scaled_mm, run_under_triton_interpreter

triton = pytest.importorskip("triton")

from miles.engines.embedded import fp8, fp8_triton, fused_forward, triton_ops  # noqa: E402
from miles.engines.embedded.kv_cache import KVCache  # noqa: E402
from miles.engines.embedded.model import CausalLM  # noqa: E402
from miles.models.tiny import make_tiny_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = triton_ops.available(DEVICE)
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.skipif(RUNS_HERE or triton_ops.INTERPRET, reason="the checks run directly here")
def test_kernels_under_interpreter():
    run_under_triton_interpreter(__file__)


def _randn(*shape: int, seed: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _assert_quantized_as_the_activation_kernel(got: fp8.QuantizedInput, output: torch.Tensor) -> None:
    """`got` holds the codes and scales of `quantize_activation(output, pad_to=4)`, bit for bit."""
    rows = output.shape[0]
    q, scales = fp8_triton.quantize_activation(output, pad_to=4)
    assert (got.rows, got.dtype, got.q.dtype) == (rows, output.dtype, torch.float8_e4m3fn)
    assert got.q.shape == q.shape and got.scales.shape == scales.shape and got.scales.stride() == scales.stride()
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scales, scales)  # pad rows included: a zero row's scale, 1e-12 / 448
    if triton_ops.INTERPRET:  # the torch form, an independent reference (on a GPU Triton's division may differ)
        q_ref, s_ref = fp8.quantize_activation(output.cpu())
        assert torch.equal(got.q[:rows].cpu().view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(got.scales[:rows].cpu(), s_ref)
        assert not got.q[rows:].view(torch.uint8).any()


@needs_kernels
@pytest.mark.parametrize("hidden", [256, 384])
@pytest.mark.parametrize(
    ("x_dtype", "residual_dtype"),
    [(BF16, None), (FP32, None), (BF16, BF16), (BF16, FP32)],
    ids=["bf16_alone", "fp32_stream_alone", "bf16_stream", "fp32_stream"],
)  # a layer's first norm reads the stream itself; the others add a GEMM output to it
def test_the_norm_kernel_quantizes_the_output_it_would_have_stored(gpu_rounding, hidden, x_dtype, residual_dtype):
    rows = 5  # padded to 8
    x = _randn(rows, hidden, seed=hidden, dtype=x_dtype) * 3
    weight = _randn(hidden, seed=1)
    residual = None if residual_dtype is None else _randn(rows, hidden, seed=2, dtype=residual_dtype)
    stream_plain = None if residual is None else residual.clone()
    stream_fused = None if residual is None else residual.clone()
    output = triton_ops.add_rms_norm(x, stream_plain, weight, 1e-6)
    got = triton_ops.add_rms_norm(x, stream_fused, weight, 1e-6, quantize=True)
    _assert_quantized_as_the_activation_kernel(got, output)
    if residual is not None:
        assert torch.equal(stream_fused, stream_plain) and not torch.equal(stream_fused, residual)


@needs_kernels
@pytest.mark.parametrize("width", [256, 384, 1280])  # one program a row; groups masked past width; two programs
def test_the_silu_kernel_quantizes_the_output_it_would_have_stored(gpu_rounding, width):
    gate_up = _randn(7, 2 * width, seed=width) * 2  # 7 rows, padded to 8
    _assert_quantized_as_the_activation_kernel(
        triton_ops.silu_mul(gate_up, quantize=True), triton_ops.silu_mul(gate_up)
    )


@needs_kernels
def test_a_quantized_output_needs_whole_groups_of_128():
    with pytest.raises(ValueError, match="whole groups of 128 channels; width is 200"):
        triton_ops.silu_mul(_randn(2, 400, seed=0), quantize=True)


# ---- the fused forwards hand the FP8 GEMMs quantized inputs


def _fp8_model(tmp_path) -> tuple[CausalLM, dict[int, str]]:
    """A tiny FP8 model every GEMM of which is whole 128-blocks, in fp16 (the interpreter has no bf16 tl.dot),
    and its FP8 weights' roles by identity."""
    path = make_tiny_model(
        str(tmp_path / "m"), hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2, init_std=0.05, seed=2
    )
    model = CausalLM.from_pretrained(path, DEVICE, torch.float16)
    model.quantize_fp8()
    roles = {id(model.storage[n[r]]): r for n in model.layer_names for r in ("qkv", "o", "gate_up", "down")}
    return model, roles


def _run_fused(model: CausalLM, path: str) -> torch.Tensor:
    """decode_fused of 3 rows (8 prefilled positions each), or prefill_fused of 2 rows of 5 and 3 tokens."""
    s = model.spec
    kw = dict(num_layers=s.num_layers, num_slots=4, max_seq_len=40, num_kv_heads=s.num_kv_heads)
    kv = KVCache(**kw, head_dim=s.head_dim, dtype=model.dtype, device=DEVICE)
    attention = triton_ops.DecodeAttention(s.num_heads, s.num_kv_heads, s.head_dim, kv.capacity, 4)
    g = torch.Generator().manual_seed(3)
    if path == "decode":  # keys and values of 8 earlier positions
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        tokens = torch.randint(3, s.vocab_size, (3,), generator=g).to(DEVICE)
        positions = torch.tensor([8, 8, 8], device=DEVICE)
        return fused_forward.decode_fused(model, tokens, positions, positions + 1, kv, attention)
    tokens = torch.randint(3, s.vocab_size, (2, 5), generator=g).to(DEVICE)
    pos = torch.arange(5, device=DEVICE)[None].expand(2, 5)
    last = torch.tensor([4, 2], device=DEVICE)
    write = torch.where(pos <= last[:, None], pos, kv.scratch_pos)
    return fused_forward.prefill_fused(model, tokens, pos, write, last, kv, 0, attention)


@needs_kernels
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_the_fused_paths_hand_qkv_gate_up_and_down_their_inputs_quantized(tmp_path, monkeypatch, gpu_rounding, path):
    """Where cuBLASLt runs the GEMMs, the norms feed qkv and gate/up and SiLU feeds down as QuantizedInputs, o
    takes the attention's model-dtype output; the hidden states are bit-equal to those with FUSED_INPUT_QUANT off
    (each GEMM quantizing its input in the activation kernel), which cuBLASLt's layouts read the same way."""
    model, roles = _fp8_model(tmp_path)
    monkeypatch.setattr(fp8, "_hopper", lambda device: True)
    monkeypatch.setattr(fp8, "_scaled_mm_ok", {})
    monkeypatch.setattr(torch, "_scaled_mm", cublaslt_scaled_mm)
    inputs: list[tuple[str, bool]] = []
    linear = fused_forward.linear

    def recorded(x, weight, bias=None):
        inputs.append((roles[id(weight)], isinstance(x, fp8.QuantizedInput)))
        return linear(x, weight, bias)

    monkeypatch.setattr(fused_forward, "linear", recorded)
    fused = _run_fused(model, path)
    per_layer = [("qkv", True), ("o", False), ("gate_up", True), ("down", True)]
    assert inputs == per_layer * model.spec.num_layers and not fp8._scaled_mm_ok
    inputs.clear()
    monkeypatch.setattr(fp8, "FUSED_INPUT_QUANT", False)
    separate = _run_fused(model, path)
    assert [quantized for _, quantized in inputs] == [False] * 4 * model.spec.num_layers
    assert fused.dtype == torch.float16 and torch.isfinite(fused).all()
    assert torch.equal(fused, separate)
