"""The reference forward both sides of a true-on-policy run score tokens with.

`sequence_logits` runs a `transformers` causal LM over one sequence (batch 1, positions 0..L-1, eager
attention, no cache) and keeps the logits of the positions that predict tokens `start..L-1`;
`token_log_probs` turns them into fp32 log-probs at a sampling temperature. The engine and the trainer
call these two functions with the same model class, the same weights (bit for bit, in the same dtype)
and the same sequence, so every kernel sees the same shapes in the same order and returns the same
bits: no batch-size-dependent reduction exists because nothing is ever batched.

`deterministic_scoring` pins what would otherwise be free to vary between two processes: on CUDA,
deterministic algorithms, IEEE fp32 matmuls (no TF32) and full-precision reductions in half-precision
GEMMs (cuBLAS also needs `CUBLAS_WORKSPACE_CONFIG`, set in both processes' environment at spawn);
on CPU, one intra-op thread, so no GEMM splits its reduction by the thread count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from miles.true_on_policy import CPU_THREADS


@contextlib.contextmanager
def deterministic_scoring(device: torch.device) -> Iterator[None]:
    """The settings a reference forward runs under; restored afterwards (the engine's own kernels keep theirs)."""
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        saved = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            matmul.fp32_precision,
            matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction,
        )
        torch.use_deterministic_algorithms(True)
        matmul.fp32_precision = "ieee"
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
            matmul.fp32_precision = saved[2]
            matmul.allow_bf16_reduced_precision_reduction = saved[3]
            matmul.allow_fp16_reduced_precision_reduction = saved[4]
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sequence_logits(model: nn.Module, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits [L - start, vocab] (the model's dtype) predicting tokens `start..L-1` of one sequence `input_ids` [L].

    Runs under `deterministic_scoring` on `input_ids`' device; differentiable when grad is enabled.
    """
    length = int(input_ids.shape[0])
    if not 1 <= start < length:
        raise ValueError(f"start={start} must be in [1, {length}): the first scored token needs a prefix")
    positions = torch.arange(length, device=input_ids.device)[None]
    with deterministic_scoring(input_ids.device):
        out = model(
            input_ids=input_ids[None], position_ids=positions, logits_to_keep=length - start + 1, use_cache=False
        )
    return out.logits[0, :-1]  # the last kept position predicts past the sequence


def scaled_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(logits / temperature) per row (temperature 0 -> 1, as the engine samples greedily)."""
    x = logits.float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(x if t == 1.0 else x / t, dim=-1)


def token_log_probs(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[i]) from rows of `scaled_log_softmax`."""
    return log_probs.gather(-1, targets[:, None]).squeeze(-1)


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)
