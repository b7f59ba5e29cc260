"""The grouped expert GEMMs (Triton) and the sorted torch path against the per-expert loop.

As tests/unit/test_triton_ops.py: on CUDA the checks run on the GPU; elsewhere this file re-runs itself in a
child process with TRITON_INTERPRET=1 (the interpreter must be on before triton is imported)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from miles.engines.embedded import moe, moe_triton, triton_ops

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RUNS_HERE = triton_ops.triton is not None and triton_ops.available(DEVICE)
needs_kernels = pytest.mark.skipif(not RUNS_HERE, reason="runs on CUDA, or in the interpreter child process")


@pytest.mark.skipif(RUNS_HERE or triton_ops.INTERPRET or triton_ops.triton is None, reason="checks run here")
def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", MILES_TORCH_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed, 2 skipped", proc.stdout.strip().splitlines()[-1]), proc.stdout[-500:]


def _case(n: int, k: int, e: int, d: int, inter: int, seed: int, unused: tuple[int, ...] = ()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    gate_up = torch.randn(e, 2 * inter, d, generator=g) * 0.2
    down = torch.randn(e, d, inter, generator=g) * 0.2
    logits = torch.randn(n, e, generator=g)
    logits[:, list(unused)] = -1e9  # experts no token picks
    probs = torch.softmax(logits, -1)
    weights, experts = torch.topk(probs, k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    return [t.to(DEVICE) for t in (x, weights, experts, gate_up, down)]


def test_sorted_torch_path_equals_the_loop():
    x, w, ex, gu, dn = _case(13, 3, 7, 16, 8, 0, unused=(2,))
    torch.testing.assert_close(moe._experts_sorted_torch(x, w, ex, gu, dn), moe.experts_loop(x, w, ex, gu, dn))


@needs_kernels
def test_align_groups_pairs_by_expert_in_padded_blocks():
    _, _, experts, _, _ = _case(9, 2, 5, 16, 8, 1, unused=(3,))
    sorted_ids, block_expert = moe_triton.align(experts, 5, block_m=4)
    pairs = experts.numel()
    assert sorted_ids.numel() == -(-(pairs + 5 * 3) // 4) * 4  # the static bound
    flat = experts.reshape(-1).cpu()
    ids, blocks = sorted_ids.cpu(), block_expert.cpu()
    assert sorted(i for i in ids.tolist() if i < pairs) == list(range(pairs))  # every pair once
    for b, e in enumerate(blocks.tolist()):
        chunk = [i for i in ids[4 * b : 4 * b + 4].tolist() if i < pairs]
        assert all(flat[i] == e for i in chunk)  # a block holds one expert's pairs
        if e == 5:
            assert not chunk  # the tail past the last run is empty


@needs_kernels
@pytest.mark.parametrize(("n", "k", "e", "d", "inter"), [(1, 2, 4, 32, 16), (21, 2, 6, 48, 24), (40, 4, 9, 32, 40)])
def test_grouped_kernels_equal_the_per_expert_loop(n, k, e, d, inter):
    x, w, ex, gu, dn = _case(n, k, e, d, inter, n, unused=(1,))
    got = moe_triton.fused_experts(x, w, ex, gu, dn)
    torch.testing.assert_close(got, moe.experts_loop(x, w, ex, gu, dn), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(triton_ops.INTERPRET, reason="Triton's CPU interpreter does not emulate bf16 tl.dot; a GPU check")
def test_grouped_kernels_in_bf16_stay_close_to_the_fp32_loop():
    x, w, ex, gu, dn = _case(24, 2, 8, 32, 16, 5)
    want = moe.experts_loop(x, w, ex, gu, dn)
    got = moe_triton.fused_experts(*(t.to(torch.bfloat16) for t in (x, w)), ex, gu.bfloat16(), dn.bfloat16())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_kernels
def test_grouped_kernels_round_where_the_torch_path_and_transformers_do(monkeypatch, gpu_rounding):
    """With ROUND_AS_TRANSFORMERS the kernels round the gate and up products, SiLU(gate), the activation, the
    down product and its weighted value in bf16 as the torch path (and transformers' experts) do: their output
    is the torch path's, but where the two GEMMs sum in another order. Kept in fp32 until the store (the
    default), it is not."""
    x, w, ex, gu, dn = (t.bfloat16() if t.is_floating_point() else t for t in _case(40, 4, 9, 64, 48, 3))
    want = moe._experts_sorted_torch(x, w, ex, gu, dn)
    # the interpreter does not emulate a bf16 tl.dot: there the operands go in as fp32 (their bf16 values,
    # exactly) and only the stored intermediates are bf16
    operands = [t.float() if triton_ops.INTERPRET and t.is_floating_point() else t for t in (x, w, ex, gu, dn)]

    def equal_share() -> float:
        got = moe_triton.fused_experts(*operands, out_dtype=torch.bfloat16)
        return (got == want).float().mean().item()

    monkeypatch.setattr(moe_triton, "ROUND_AS_TRANSFORMERS", True)
    rounded = equal_share()
    monkeypatch.setattr(moe_triton, "ROUND_AS_TRANSFORMERS", False)
    fused = equal_share()
    assert rounded == 1.0 if triton_ops.INTERPRET else rounded >= 0.95, rounded
    assert fused < 0.9 and fused < rounded, (fused, rounded)
