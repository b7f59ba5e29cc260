"""Per-token KL estimators between a policy and a reference, from sampled-token log-probs.

With Δ = logπ − logπ_ref (tokens sampled from π):
  k1 = Δ                      unbiased, high variance, can be negative per token
  k2 = Δ² / 2                 biased, always >= 0
  k3 = e^{−Δ} − 1 + Δ         unbiased, >= 0, low variance
  low_var_kl = k3 with −Δ nan-cleaned and clamped to [−20, 20] before exp and the result clamped to
               [−10, 10], so one outlier token cannot blow up a step.
All arithmetic is fp32 regardless of the input dtype (bf16 differences of log-probs lose the signal).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """Per-token KL(π || π_ref) estimate, same shape as the inputs, fp32."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ")
    delta = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return delta
    if kl_type == "k2":
        return delta.square() * 0.5
    if kl_type == "k3":
        return torch.expm1(-delta) + delta
    if kl_type == "low_var_kl":
        u = torch.nan_to_num(-delta, nan=0.0).clamp(-20.0, 20.0)
        return (torch.expm1(u) - u).clamp(-10.0, 10.0)
    raise ValueError(f"kl_type={kl_type!r} is not one of {KL_TYPES} (set --kl-loss-type)")
