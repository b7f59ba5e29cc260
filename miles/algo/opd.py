"""On-policy distillation: a teacher's judgement folded into the advantage as a dense penalty.

The per-token signal is a reverse-KL estimate KL(student || teacher) at each position. It is
subtracted (times a coefficient) from the estimator's advantage, after the estimator and before
whitening, so it composes with every estimator and the policy loss is unchanged. Both
log-probabilities are fixed inputs (no gradient flows through the penalty).
"""

from __future__ import annotations

import torch
from torch import Tensor

TOPK_WEIGHTS = ("student", "normalized", "uniform")


def sampled_reverse_kl(student_log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    """One-sample reverse-KL estimate at the sampled token: logπ_student − logπ_teacher (fp32, detached)."""
    if student_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"student_log_probs {tuple(student_log_probs.shape)} and teacher_log_probs "
            f"{tuple(teacher_log_probs.shape)} differ; both must be per response token"
        )
    return (student_log_probs.detach().float() - teacher_log_probs.detach().float()).nan_to_num(0.0, 0.0, 0.0)


def apply_opd(
    advantages: Tensor,
    *,
    student_log_probs: Tensor | None,
    teacher_log_probs: Tensor | None = None,
    opd_reverse_kl: Tensor | None = None,
    coef: float,
) -> Tensor:
    """advantages − coef · reverse_kl, using the precomputed top-K estimate when given, else the sampled one."""
    if opd_reverse_kl is not None:
        penalty = opd_reverse_kl.detach().float().nan_to_num(0.0, 0.0, 0.0)
    elif teacher_log_probs is not None and student_log_probs is not None:
        penalty = sampled_reverse_kl(student_log_probs, teacher_log_probs)
    else:
        raise ValueError(
            "--use-opd needs per-token teacher log-probs (and the student's old log-probs) or a precomputed "
            "opd_reverse_kl; none reached the trainer: set a teacher (--opd-teacher-url) that scores the rollouts"
        )
    if penalty.shape != advantages.shape:
        raise ValueError(f"OPD penalty has shape {tuple(penalty.shape)} but advantages {tuple(advantages.shape)}")
    return advantages - coef * penalty


def topk_reverse_kl(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor, weights: str = "student") -> Tensor:
    """Reverse KL estimated over K candidate tokens per position: [T, K] x 2 -> [T].

    Both inputs hold log-probs (over the full vocabulary) of the same K candidate tokens.
      student:    Σ_k p_s(k) (log p_s(k) − log p_t(k)) — the full-vocabulary KL's terms restricted
                  to the candidate set (exact when the set covers the student's mass).
      normalized: KL between the student and teacher renormalised over the set; always >= 0.
      uniform:    mean_k (log p_s(k) − log p_t(k)).
    Non-finite entries (a candidate the teacher did not score) contribute 0.
    """
    if student_topk_logprobs.shape != teacher_topk_logprobs.shape or student_topk_logprobs.dim() != 2:
        raise ValueError(
            f"top-K log-probs must both be [T, K]; got {tuple(student_topk_logprobs.shape)} and "
            f"{tuple(teacher_topk_logprobs.shape)}"
        )
    s = student_topk_logprobs.detach().float()
    t = teacher_topk_logprobs.detach().float()
    valid = torch.isfinite(s) & torch.isfinite(t)
    if weights == "normalized":
        neg_inf = torch.full_like(s, float("-inf"))
        s = torch.log_softmax(torch.where(valid, s, neg_inf), dim=-1)
        t = torch.log_softmax(torch.where(valid, t, neg_inf), dim=-1)
        w = s.exp()
    elif weights == "student":
        w = s.exp()
    elif weights == "uniform":
        w = valid.float() / valid.float().sum(-1, keepdim=True).clamp(min=1.0)
    else:
        raise ValueError(f"top-K OPD weights={weights!r} is not one of {TOPK_WEIGHTS}")
    terms = torch.where(valid, w * (s - t), torch.zeros_like(s))
    return terms.sum(-1)
