"""On-policy distillation: a teacher's judgement folded into the advantage as a dense penalty.

The per-token signal is a reverse-KL estimate KL(student || teacher) at each position. It is
subtracted (times a coefficient) from the estimator's advantage, after the estimator and before
whitening, so it composes with every estimator and the policy loss is unchanged. Both
log-probabilities are fixed inputs (no gradient flows through the penalty).

The top-K estimate (`topk_reverse_kl`, "Rethinking OPD") is a weighted sum over a candidate set per
position, computed on the rollout side, where the teacher's and the student's top-K log-probs arrive
(miles/rollout/opd_teacher.py). It estimates the position's KL with less noise than one sample, but it
does not depend on the sampled token, so it serves as the baseline of the sampled token's log-ratio
(`apply_opd`), not as the penalty itself.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tensors only pass through: the controller imports the top-K math without torch
    from torch import Tensor

TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
REWARD_WEIGHT_MODES = ("student_p", "teacher_p", "none")
# The log-probs each strategy reads: the student's top-K (recorded while sampling), the teacher's top-K,
# the teacher's log-probs of the student's candidates, the student's of the teacher's.
NEEDS_STUDENT_TOP = frozenset({"only-student", "intersection", "union", "xor"})
NEEDS_TEACHER_TOP = frozenset({"only-teacher", "intersection", "union", "xor"})
NEEDS_TEACHER_ON_STUDENT = frozenset({"only-student", "union", "xor"})
NEEDS_STUDENT_ON_TEACHER = frozenset({"only-teacher", "union", "xor"})
LogProbs = dict[int, float]  # token id -> log-prob at one position


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
    """advantages − coef · penalty: the sampled token's log-ratio, minus the top-K estimate when given.

    Only the sampled token's term tells the policy gradient which action to move: its expectation over
    the action is the reverse KL, and reinforcing −(log p_s(a) − log p_t(a)) follows the KL's gradient.
    The top-K estimate is a property of the position (the same whatever token was sampled), so on its
    own as a penalty its expected gradient is zero: it only pushes every sampled token down, the policy
    spreads away from the teacher and the KL grows (measured: docs/distillation.md). It is used as the
    baseline of the sampled term instead, which keeps the gradient's expectation and lowers its variance.
    """
    if teacher_log_probs is not None and student_log_probs is not None:
        penalty = sampled_reverse_kl(student_log_probs, teacher_log_probs)
        if opd_reverse_kl is not None:
            penalty = penalty - opd_reverse_kl.detach().float().nan_to_num(0.0, 0.0, 0.0)
    elif opd_reverse_kl is not None:
        raise ValueError(
            "top-K OPD needs the teacher's log-probs of the sampled tokens too (the top-K estimate is only "
            "their baseline); the rollout stores both when a teacher scores the sample"
        )
    else:
        raise ValueError(
            "--use-opd needs per-token teacher log-probs (and the student's old log-probs) or a precomputed "
            "opd_reverse_kl; none reached the trainer: the rollout must be scored by a teacher "
            "(--opd-teacher-urls / --opd-teacher-load)"
        )
    if penalty.shape != advantages.shape:
        raise ValueError(f"OPD penalty has shape {tuple(penalty.shape)} but advantages {tuple(advantages.shape)}")
    return advantages - coef * penalty


def candidates(strategy: str, student_ids: list[int], teacher_ids: list[int]) -> list[int]:
    """The token ids one position's top-K estimate sums over, in a fixed order (student's first)."""
    s_set, t_set = set(student_ids), set(teacher_ids)
    if strategy == "only-student":
        return list(student_ids)
    if strategy == "only-teacher":
        return list(teacher_ids)
    if strategy == "intersection":
        return [t for t in student_ids if t in t_set]
    if strategy == "union":
        return list(dict.fromkeys([*student_ids, *teacher_ids]))
    if strategy == "xor":
        return [t for t in [*student_ids, *teacher_ids] if (t in s_set) != (t in t_set)]
    raise ValueError(f"--opd-top-k-strategy={strategy!r} is not one of {TOP_K_STRATEGIES}")


def _weights(student: list[float], teacher: list[float], mode: str, normalize: bool) -> list[float]:
    """Each candidate's weight: the chosen side's probability, softmax-renormalised over the set when
    `normalize` (every strategy but xor, whose set has no common mass to renormalise)."""
    if mode not in REWARD_WEIGHT_MODES:
        raise ValueError(f"--opd-reward-weight-mode={mode!r} is not one of {REWARD_WEIGHT_MODES}")
    logps = student if mode == "student_p" else teacher if mode == "teacher_p" else [0.0] * len(student)
    if not normalize:
        return [math.exp(x) for x in logps]
    top = max(logps)
    exps = [math.exp(x - top) for x in logps]
    total = sum(exps)
    return [x / total for x in exps]


def _lookup(token: int, first: LogProbs, second: LogProbs, side: str, position: int) -> float:
    if token in first:
        return first[token]
    if token in second:
        return second[token]
    raise ValueError(f"top-K OPD: no {side} log-prob for candidate token {token} at response position {position}")


def topk_reverse_kl(
    student_top: list[LogProbs],
    teacher_top: list[LogProbs],
    teacher_on_student: list[LogProbs],
    student_on_teacher: list[LogProbs],
    strategy: str = "only-student",
    weight_mode: str = "student_p",
) -> list[float]:
    """Reverse KL per response position, estimated over a candidate set ("Rethinking OPD"):
    Σ_{k ∈ set} w_k (log p_s(k) − log p_t(k)).

    Each argument holds one {token id: log-prob} map per position: the student's and the teacher's top-K,
    the teacher's log-probs of the student's candidates and the student's of the teacher's (maps a
    strategy does not read may be empty). The set and the weights follow `strategy` and `weight_mode`;
    an empty set (e.g. a disjoint intersection) gives 0.
    """
    lengths = {len(student_top), len(teacher_top), len(teacher_on_student), len(student_on_teacher)}
    if len(lengths) != 1:
        raise ValueError(f"top-K OPD: per-position maps of different lengths {sorted(lengths)}")
    out = []
    for pos, (s_top, t_top, t_on_s, s_on_t) in enumerate(
        zip(student_top, teacher_top, teacher_on_student, student_on_teacher, strict=True)
    ):
        ids = candidates(strategy, list(s_top), list(t_top))
        if not ids:
            out.append(0.0)
            continue
        s = [_lookup(t, s_top, s_on_t, "student", pos) for t in ids]
        t = [_lookup(k, t_top, t_on_s, "teacher", pos) for k in ids]
        w = _weights(s, t, weight_mode, normalize=strategy != "xor")
        out.append(sum(wk * (sk - tk) for wk, sk, tk in zip(w, s, t, strict=True)))
    return out
