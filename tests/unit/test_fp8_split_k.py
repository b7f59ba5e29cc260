"""Split-K of the block-scaled FP8 GEMM (fp8_split_k): chunks of whole scale groups, the scale layouts cuBLASLt
reads, the sum equal to the whole GEMM's up to fp32 order, the policy, and the fall-back when a chunk is refused.
cuBLASLt's block-scaled `torch._scaled_mm` runs only on Hopper: here a stand-in computes its product from the
operands as cuBLASLt reads them; tests/gpu/test_fp8_gpu.py checks the real call and its CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from miles.engines.embedded import fp8, fp8_split_k


def _block_scaled(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's 1x128 / 128x128 product, reading the scales as cuBLASLt does: the activation's
    outer-dim-major (stride 1 along rows), the weight's [L, NB] as the transpose of a contiguous [NB, L]."""
    assert a.dtype == b.dtype == fp8.E4M3 and a.stride(1) == 1 and b.stride(0) == 1
    assert scale_a.stride(0) == 1, "activation scales must be outer-dim-major"
    assert scale_b.t().is_contiguous(), "weight scales must be a contiguous [NB, L] seen transposed"
    assert scale_a.shape[1] == scale_b.shape[0] == a.shape[1] // fp8.BLOCK
    n = b.shape[1]
    da = a.float() * scale_a.repeat_interleave(fp8.BLOCK, 1)
    db = b.float() * scale_b.repeat_interleave(fp8.BLOCK, 0).repeat_interleave(fp8.BLOCK, 1)[:, :n]
    return (da @ db).to(out_dtype)


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.rand(n, 1, generator=g) + 0.05  # block scales that differ
    w = (torch.randn(n, k, generator=g) * rows / 20).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    xq, xs = fp8.quantize_activation(x)
    wq, ws = fp8.quantize_weight_torch(w)
    return x, xq, xs.t().contiguous().t(), wq, ws


@pytest.mark.parametrize(("blocks", "splits"), [(4, 1), (8, 2), (12, 2), (148, 2), (148, 3), (16, 4)])
def test_chunks_are_whole_groups_of_four_blocks_covering_k(blocks, splits):
    chunks = fp8_split_k.chunk_blocks(blocks, splits)
    assert len(chunks) == splits and chunks[0][0] == 0 and chunks[-1][1] == blocks
    assert all(a < b and a % 4 == 0 and b % 4 == 0 for a, b in chunks)
    assert all(chunks[i][1] == chunks[i + 1][0] for i in range(splits - 1))
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 4


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_the_split_product_is_the_whole_product_up_to_fp32_order(splits):
    _, xq, xs, wq, ws = _operands(m=8, n=256, k=2048)  # 16 blocks, 4 groups
    whole = _block_scaled(xq, wq.t(), xs, ws.contiguous().t(), torch.float32)
    calls = []

    def mm(*args, **kwargs):
        calls.append(kwargs["scale_b"].shape)
        return _block_scaled(*args, **kwargs)

    got = fp8_split_k.split_k_mm(xq, xs, wq, ws, torch.float32, splits, mm=mm)
    assert len(calls) == splits and sum(shape[0] for shape in calls) == ws.shape[1]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5 * whole.abs().max().item())
    assert fp8_split_k.split_k_mm(xq, xs, wq, ws, torch.bfloat16, splits, mm=mm).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("rows", "n", "k", "want"),
    [
        (256, 3584, 18944, 2),  # the 7B down projection: 56 tiles on 132 SMs
        (256, 3584, 3584, 1),  # o: 56 tiles, but 28 blocks of K: too short to pay for the chunks' sum
        (256, 4608, 3584, 1),  # qkv: 72 tiles
        (256, 37888, 3584, 1),  # gate/up: 592 tiles
        (4, 3584, 18944, 4),  # one tile row: capped at MAX_SPLITS
        (4, 3584, 8192, 2),  # 64 blocks of K: two chunks of 32
        (256, 896, 4864, 1),  # K/128 = 38: the padded path stays whole
    ],
)
def test_auto_splits_by_the_tiles_the_sms_hold(monkeypatch, rows, n, k, want):
    monkeypatch.setattr(fp8_split_k, "_sm_count", lambda device: 132)
    assert fp8_split_k.splits_for(rows, n, k, torch.device("cpu"), "auto") == want


def test_fixed_and_off_policies():
    cpu = torch.device("cpu")
    assert fp8_split_k.splits_for(256, 3584, 18944, cpu, 0) == 1
    assert fp8_split_k.splits_for(256, 3584, 18944, cpu, 3) == 3
    assert fp8_split_k.splits_for(256, 3584, 1024, cpu, 4) == 2  # never more chunks than groups


@pytest.mark.parametrize("text", ["5", "two", "-1", ""])
def test_a_bad_setting_is_refused_by_name(text):
    with pytest.raises(ValueError, match="MILES_FP8_SPLIT_K"):
        fp8_split_k.parse(text)
    assert fp8_split_k.parse("auto") == "auto" and fp8_split_k.parse("0") == 0


def test_block_scaled_mm_splits_and_falls_back_to_whole_gemms_when_a_chunk_is_refused(monkeypatch):
    x, _, _, wq, ws = _operands(m=8, n=256, k=2048)
    weight = fp8.Fp8Weight(wq, ws)
    calls = []

    def scaled_mm(*args, **kwargs):
        calls.append(kwargs["out_dtype"])
        if refuse_fp32 and kwargs["out_dtype"] == torch.float32:
            raise RuntimeError("no fp32 output here")
        return _block_scaled(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(fp8, "_split_ok", {})
    want = fp8._emulated(x, weight, torch.float32)

    refuse_fp32 = False
    got = fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=2)
    assert calls == [torch.float32, torch.float32] and got.shape == (8, 256)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2

    calls.clear()
    refuse_fp32 = True
    got = fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=2)
    assert calls == [torch.float32, torch.bfloat16] and fp8._split_ok == {x.device: False}
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    calls.clear()
    fp8._block_scaled_mm(x, weight, torch.bfloat16, splits=2)
    assert calls == [torch.bfloat16]  # remembered: whole GEMMs from then on


def test_the_gemm_bench_times_whole_split_and_auto_gemms_and_checks_each(monkeypatch):
    from tests.unit.bench_modules import load_bench

    bench = load_bench("fp8_gemm")
    monkeypatch.setattr(torch, "_scaled_mm", _block_scaled)
    monkeypatch.setattr(fp8, "_split_ok", {})
    monkeypatch.setattr(fp8_split_k, "_sm_count", lambda device: 132)
    timed = []
    monkeypatch.setattr(bench, "_time_us", lambda fn, reps, cuda: timed.append(fn().shape) or 10.0 + len(timed))
    x, _, _, wq, ws = _operands(m=8, n=256, k=2048)
    weight = fp8.Fp8Weight(wq, ws)
    want = fp8._emulated(x, weight, torch.float32)
    args = bench.parse_args(["--device", "cpu", "--batch", "8", "--splits", "2,3,4,8"])
    got = bench._cublas_timings(x, weight, want, want.abs().max().item(), args, torch.bfloat16)
    # K = 2048 is four groups: 2, 3 and 4 chunks allowed, 8 not; auto: 16 blocks, under one chunk's minimum -> 1
    assert set(got["cublas_split_us"]) == {"2", "3", "4"} and got["auto_splits"] == 1
    assert got["cublas_us"] == 11.0 and got["cublas_split_best_us"] == 11.0 and got["cublas_auto_us"] == 15.0
    assert got["cublas_rel_diff"] < 1e-2 and not got["split_refused"] and len(timed) == 5


@pytest.mark.parametrize("env", [{"MILES_FP8_CUDA_KERNELS": "0"}, {"MILES_FP8_GEMM": "triton"}])
def test_split_k_without_the_cublas_kernels_is_refused_at_import(env):
    import os
    import subprocess
    import sys

    full = (
        {k: v for k, v in os.environ.items() if not k.startswith("MILES_FP8_")} | env | {"MILES_FP8_SPLIT_K": "auto"}
    )
    proc = subprocess.run(
        [sys.executable, "-c", "import miles.engines.embedded.fp8"], env=full, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "unset MILES_FP8_SPLIT_K" in proc.stderr


@pytest.mark.parametrize(
    ("env", "kernels"),
    [({}, True), ({"MILES_FP8_CUDA_KERNELS": "0"}, False), ({"MILES_FP8_CUDA_KERNELS": "yes"}, None)],
)
def test_the_cuda_kernels_are_on_unless_switched_off_and_other_values_are_refused(env, kernels):
    import os
    import subprocess
    import sys

    full = {k: v for k, v in os.environ.items() if not k.startswith("MILES_FP8_")} | env
    code = "from miles.engines.embedded import fp8; print(fp8.CUDA_KERNELS)"
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)
    if kernels is None:
        assert proc.returncode != 0 and "MILES_FP8_CUDA_KERNELS='yes': use 1" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == str(kernels)


def _any_block_scaled(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's three block-scaled forms on Hopper, told apart by the scales' shapes as torch's check
    tells them: a 1x128 operand has one scale per row (of a) or column (of b) and K block, a 128x128 one per
    block."""
    (m, k), n = a.shape, b.shape[1]

    def rows_of(s, count):  # [count or count/128, L] -> [count, K]
        s = s if s.shape[0] == count else s.repeat_interleave(fp8.BLOCK, 0)[:count]
        return s.repeat_interleave(fp8.BLOCK, 1)[:, :k]

    assert scale_a.shape[1] == scale_b.shape[0] == k // fp8.BLOCK
    da = a.float() * rows_of(scale_a, m)
    db = b.float() * rows_of(scale_b.t(), n).t()
    return (da @ db).to(out_dtype)


def test_the_gemm_bench_times_each_scale_layout_on_the_same_codes(monkeypatch):
    from tests.unit.bench_modules import load_bench

    bench = load_bench("fp8_gemm")
    monkeypatch.setattr(torch, "_scaled_mm", _any_block_scaled)
    monkeypatch.setattr(bench, "_time_us", lambda fn, reps, cuda: 7.0)
    x, xq, xs, wq, ws = _operands(m=8, n=384, k=512)
    weight = fp8.Fp8Weight(wq, ws)
    want = fp8._emulated(x, weight, torch.float32)
    got = bench._cublas_layout_timings(weight, xq, xs, want, want.abs().max().item(), reps=3)["cublas_layouts"]
    assert set(got) == {"block", "rows", "swapped"}
    for label, timing in got.items():  # each form's first layout computes the engine's product
        assert timing["layout"] == 0 and timing["us"] == 7.0 and timing["rel_diff"] < 1e-2, (label, timing)
    # a form whose scales are read another way is not timed: the weight's block scales swapped for others
    wrong = bench._cublas_layout_timings(fp8.Fp8Weight(wq, ws.flip(0)), xq, xs, want, want.abs().max().item(), 3)
    assert all("errors" in t for t in wrong["cublas_layouts"].values())


def test_each_scale_layouts_operands_pass_torchs_block_scaled_shape_check():
    from miles.engines.embedded import fp8_forms

    m, n, k = 256, 512, 1024
    wq, xq = torch.empty(n, k, dtype=fp8.E4M3, device="meta"), torch.empty(m, k, dtype=fp8.E4M3, device="meta")
    ws = torch.ones(n // 128, k // 128, device="meta")
    xs = torch.ones(m, k // 128, device="meta").t().contiguous().t()  # outer-dim-major, as the engine passes it
    for label in fp8_forms.FORMS:
        for layout in range(fp8_forms.LAYOUTS[label]):  # torch's meta check refuses shapes of no block-scaled form
            assert fp8_forms.mm(label, layout, xq, xs, wq, ws, torch.bfloat16).shape == (m, n), label
