"""FP8 Triton kernels (fp8_triton.py) against the torch forms in fp8.py.

On CUDA the checks run on the GPU; elsewhere under Triton's interpreter in a child process (the
interpreter must be on before triton is imported), as tests/unit/test_triton_ops.py does. The
interpreter's fp32 -> e4m3 conversion (triton 3.6) is not the GPU's: ties go away from zero (17 -> 18)
and a round-up into the next power of two loses its carry (31.5 -> 16), so the codes themselves are
compared on CUDA only; scales, layout and padding everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from miles.engines.embedded import fp8, fp8_triton, triton_ops  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = triton_ops.available(DEVICE)
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")


@pytest.mark.skipif(RUNS_HERE or triton_ops.INTERPRET, reason="the checks run directly here")
def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed, 1 skipped", summary), summary


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of e4m3 codes that are equal (the kernel's fp32 division may round a tie the other way)."""
    return (a.view(torch.uint8) == b.view(torch.uint8)).float().mean().item()


@needs_kernels
def test_weight_quant_kernel_matches_the_torch_form():
    w = (torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16).to(DEVICE)
    q, s = fp8_triton.quantize_weight(w)
    q_ref, s_ref = fp8.quantize_weight(w.cpu())  # the torch form (on CPU it never calls the kernel)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert q.shape == (200, 300) and s.shape == (2, 3)
    if DEVICE.type == "cuda":
        assert _agree(q.cpu(), q_ref) > 0.999
        dq = fp8.dequantize_weight(q.cpu(), s.cpu())
        assert ((dq - w.cpu().float()).abs() <= fp8.error_bound(dq, s.cpu()) * 1.001).all()


@needs_kernels
def test_activation_quant_kernel_pads_rows_and_lays_scales_out_outer_dim_major():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    q, s = fp8_triton.quantize_activation(x, pad_to=4)
    assert q.shape == (8, 256) and s.shape == (8, 2) and s.stride() == (1, 8)
    q_ref, s_ref = fp8.quantize_activation(x.cpu())
    torch.testing.assert_close(s[:5].cpu(), s_ref, rtol=1e-6, atol=0)
    if DEVICE.type == "cuda":
        assert _agree(q[:5].cpu(), q_ref) > 0.999
    assert (q[5:].float() == 0).all()  # padded rows carry zeros, not stale memory
