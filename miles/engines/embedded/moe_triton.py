"""Grouped expert GEMMs in Triton: every token-expert pair of a MoE layer in two kernel launches.

Layout (as SGLang's fused_moe): the N x k pairs are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so a block of BLOCK_M sorted pairs belongs to one expert. `align` builds that layout
with torch ops whose shapes depend only on N, k and E (an upper bound of blocks, M + E x (BLOCK_M - 1)
pairs): no host sync, so a decode step stays capturable in a CUDA graph; blocks past the last expert's
run carry the expert id E and return at once.

Kernels, each over (blocks, output-column tiles), fp32 accumulation:
1. act[pair] = SiLU(x[token] @ gate_e^T) * (x[token] @ up_e^T)  (gate_up [E, 2I, D], gate rows first);
2. y[pair] = weight[pair] * (act[pair] @ down_e^T)              (down [E, D, I]);
then out[token] = sum over its k pairs of y, in torch (no atomics: deterministic).

Rounding (`ROUND_AS_TRANSFORMERS`, on by default): the kernels round where transformers' experts (and the
engine's torch path, `moe.py`) do, in the output dtype: the gate and up products, SiLU(gate), the activation,
the down product and its weighted value, each once. The trainer scores with transformers' experts, so with
routing replayed the two forwards differ only in the order of the GEMMs' fp32 sums (under the interpreter the
outputs equal the torch path's, tests/unit/test_moe_triton.py). Off, every intermediate stays in fp32 and each
kernel rounds once, on store. On an H100 at real proportions (bench/results/moe.md) rounding as transformers
does lowered the train/rollout log-prob gap with R3 from 3.59e-3 to 2.71e-3 nats a token (max 3.1e-2 to
1.6e-2) and the tokens routed differently without R3 from 75% to 54%
(`bench/moe.py --engine-moe-rounding transformers|fused` sets it).

Runs on CUDA, and under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), as the tests check it.
"""

from __future__ import annotations

import torch

from miles.engines.embedded import triton_ops
from miles.engines.embedded.triton_kernels import tl, triton

BLOCK_M = 16  # pairs per block: tl.dot's minimum; decode batches give each expert only a few pairs
ROUND_AS_TRANSFORMERS = True  # see the module doc


def usable(x: torch.Tensor) -> bool:
    """True where the kernels run on x's device (CUDA with triton, or the interpreter)."""
    return triton_ops.available(x.device)


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [P], block_expert [P / block_m]) for the pairs of experts [N, k]: sorted_ids lists pair ids
    (token * k + slot) grouped by expert, each group padded with the sentinel N * k to a multiple of block_m;
    block_expert[b] is the expert of block b (num_experts for the unused tail). P = N*k + E*(block_m - 1),
    rounded up to block_m: static for given N, k, E."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (pad_end - padded)[sorted_experts] + rank
    total = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((total,), pairs, dtype=torch.int64, device=flat.device)
    sorted_ids[dest] = order
    starts = torch.arange(0, total, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, starts, right=True)  # == num_experts past the last run
    return sorted_ids, block_expert


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Σ_k weights[:, k] * expert_{experts[:, k]}(x) for x [N, D] (see experts_loop), in two Triton launches.
    out_dtype (default x's): what the activation and the pairs' outputs are stored and rounded in."""
    n, k = experts.shape
    num_experts, two_i, d = gate_up.shape
    inter = two_i // 2
    pairs = n * k
    sorted_ids, block_expert = align(experts, num_experts)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    out_dtype = out_dtype or x.dtype
    act = torch.empty((pairs, inter), dtype=out_dtype, device=x.device)
    y = torch.empty((pairs, d), dtype=out_dtype, device=x.device)
    rounding = ROUND_AS_TRANSFORMERS
    scale = weights.reshape(-1).contiguous()
    blocks = block_expert.numel()
    bn, bk = _tiles(inter, d, x.device)
    _grouped_gemm_kernel[(blocks, triton.cdiv(inter, bn))](
        x, gate_up, act, sorted_ids, block_expert, scale, pairs,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        K=d, N=inter, num_experts=num_experts, A_DIV=k, SILU_GATE=True, SCALE=False, ROUND=rounding,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    bn, bk = _tiles(d, inter, x.device)
    _grouped_gemm_kernel[(blocks, triton.cdiv(d, bn))](
        act, down, y, sorted_ids, block_expert, scale, pairs,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0),
        K=inter, N=d, num_experts=num_experts, A_DIV=1, SILU_GATE=False, SCALE=True, ROUND=rounding,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
    )  # fmt: skip
    return y.view(n, k, d).sum(dim=1)


def _tiles(out_cols: int, reduce: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): wide tiles on a GPU; small ones under the interpreter (each is a numpy loop there)."""
    if device.type != "cuda":
        return 16, 16
    return (64 if out_cols >= 64 else 32), (64 if reduce >= 64 else 32)


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, scale_ptr,
        num_pairs, stride_a, stride_we, stride_wn, stride_c,
        K: tl.constexpr, N: tl.constexpr, num_experts: tl.constexpr, A_DIV: tl.constexpr, SILU_GATE: tl.constexpr, SCALE: tl.constexpr,
        ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """c[pair, n-tile] = A[pair // A_DIV] @ W[e]^T for the BLOCK_M sorted pairs of block pid_m (expert e);
        SILU_GATE: W holds gate rows [0, N) and up rows [N, 2N), stored SiLU(gate) * up; SCALE: x scale[pair].
        ROUND: every intermediate rounded to c's dtype where transformers' experts round (the module doc)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:
            return
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_pairs
        rows = tl.where(valid, ids // A_DIV, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + rows[:, None] * stride_a + offs_k[None, :],
                mask=valid[:, None] & (offs_k[None, :] < K),
                other=0.0,
            )
            w_mask = (offs_n[None, :] < N) & (offs_k[:, None] < K)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            a = a.to(w.dtype)  # no-op but where the activation is stored narrower than the weights (tests)
            acc += tl.dot(a, w, input_precision="ieee")  # ieee: an fp32 model stays fp32 (not tf32)
            if SILU_GATE:
                wu = tl.load(w_base + (offs_n[None, :] + N) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
                acc_up += tl.dot(a, wu, input_precision="ieee")
        dt = c_ptr.dtype.element_ty
        if SILU_GATE:
            if ROUND:  # gate and up as the GEMM's outputs, SiLU(gate), then their product: each rounded
                gate = acc.to(dt).to(tl.float32)
                acc = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
            else:
                acc = acc * tl.sigmoid(acc) * acc_up
        if SCALE:
            if ROUND:  # the down product rounded before its routing weight
                acc = acc.to(dt).to(tl.float32)
            acc = acc * tl.load(scale_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
        out = c_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * stride_c + offs_n[None, :]
        tl.store(out, acc.to(dt), mask=valid[:, None] & (offs_n[None, :] < N))
