"""Advantage estimators, whitening and OPD against plain Python-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.advantages import check_algo_config, compute_advantages_and_returns, discounted_reverse_cumsum
from miles.algo.opd import apply_opd
from miles.algo.whiten import masked_whiten
from miles.config import AlgoConfig

torch.set_num_threads(1)

# Samples: normal; zero-length; fully masked; tool span in the middle and a masked tail.
LENGTHS = [3, 0, 2, 6]
MASK = [1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 0]
REWARDS = [1.0, 0.5, -2.0, 3.0]
LOGP = [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7, -0.8, -0.9, -1.0, -1.1]
REF = [-0.3, -0.1, -0.3, -0.9, -0.2, -0.6, -0.5, -0.1, -0.9, -1.4, -0.2]


def _split(values, lengths=LENGTHS):
    out, start = [], 0
    for n in lengths:
        out.append(list(values[start : start + n]))
        start += n
    return out


def _whiten_ref(x, m):
    n = sum(m)
    mean = sum(a for a, b in zip(x, m, strict=True) if b) / n
    var = sum((a - mean) ** 2 for a, b in zip(x, m, strict=True) if b) / n
    return [(a - mean) / math.sqrt(var + 1e-8) if b else 0.0 for a, b in zip(x, m, strict=True)]


def _run(cfg, **kw):
    kw.setdefault("rewards", torch.tensor(REWARDS))
    kw.setdefault("response_lengths", LENGTHS)
    kw.setdefault("loss_mask", torch.tensor(MASK, dtype=torch.float32))
    adv, ret = compute_advantages_and_returns(cfg, **kw)
    return adv.tolist(), ret.tolist()


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_grpo_broadcasts_normalised_reward_on_trainable_tokens(estimator):
    adv, ret = _run(AlgoConfig(advantage_estimator=estimator, kl_coef=0.5))  # kl_coef has no effect here
    want = [1.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 0.0]
    assert adv == pytest.approx(want)
    assert ret == pytest.approx(want)


def test_grpo_all_equal_rewards_group_gives_zero_even_when_whitened():
    # Group-normalised equal rewards are 0; whitening a constant must not divide 0 by 0.
    cfg = AlgoConfig(advantage_estimator="grpo", normalize_advantages=True)
    adv, _ = _run(cfg, rewards=torch.zeros(4))
    assert adv == [0.0] * 11


def test_grpo_whitened_matches_reference():
    adv, _ = _run(AlgoConfig(advantage_estimator="grpo", normalize_advantages=True))
    raw = [1.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 0.0]
    assert adv == pytest.approx(_whiten_ref(raw, MASK), abs=1e-5)


def test_reinforce_plus_plus_baseline_subtracts_token_kl_then_whitens():
    cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1, normalize_advantages=True)
    adv, ret = _run(cfg, log_probs=torch.tensor(LOGP), ref_log_probs=torch.tensor(REF))
    rewards_per_token = [r for r, n in zip(REWARDS, LENGTHS, strict=True) for _ in range(n)]
    shaped = [(r - 0.1 * (a - b)) if m else 0.0 for r, a, b, m in zip(rewards_per_token, LOGP, REF, MASK, strict=True)]
    assert ret == pytest.approx(shaped, abs=1e-6)
    assert adv == pytest.approx(_whiten_ref(shaped, MASK), abs=1e-5)


def _rpp_reference(gamma, kl_coef, kl):
    out = []
    for r, m, k in zip(REWARDS, _split(MASK), _split(kl), strict=True):
        rho = [-kl_coef * ki * mi for ki, mi in zip(k, m, strict=True)]
        trainable = [t for t, mi in enumerate(m) if mi]
        if trainable:
            rho[trainable[-1]] += r
        g, ret = 0.0, [0.0] * len(rho)
        for t in reversed(range(len(rho))):
            g = rho[t] + gamma * g
            ret[t] = g if m[t] else 0.0
        out += ret
    return out


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_reinforce_plus_plus_discounted_returns(kl_type):
    cfg = AlgoConfig(
        advantage_estimator="reinforce_plus_plus",
        kl_coef=0.05,
        gamma=0.9,
        normalize_advantages=True,
        kl_loss_type=kl_type,
    )
    adv, ret = _run(cfg, log_probs=torch.tensor(LOGP), ref_log_probs=torch.tensor(REF))
    if kl_type == "k1":
        kl = [a - b for a, b in zip(LOGP, REF, strict=True)]
    else:
        kl = [math.exp(b - a) - 1 - (b - a) for a, b in zip(LOGP, REF, strict=True)]
    want = _rpp_reference(0.9, 0.05, kl)
    assert ret == pytest.approx(want, abs=1e-6)
    assert adv == pytest.approx(_whiten_ref(want, MASK), abs=1e-5)


def test_reinforce_plus_plus_reward_lands_on_last_trainable_token():
    cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5, normalize_advantages=True)
    _, ret = _run(cfg, rewards=torch.tensor([0.0, 0.0, 0.0, 8.0]))
    # Sample 3 mask [1, 1, 0, 0, 1, 0]: reward at position 4; returns 8*0.5^(4-t) on trainable positions.
    assert ret[5:] == pytest.approx([0.5, 1.0, 0.0, 0.0, 8.0, 0.0])


def _gae_reference(values, gamma, lambd):
    adv_all, ret_all = [], []
    for r, m, v in zip(REWARDS, _split(MASK), _split(values), strict=True):
        idx = [t for t, mi in enumerate(m) if mi]
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        last_gae = 0.0
        for j in reversed(range(len(idx))):
            v_next = v[idx[j + 1]] if j + 1 < len(idx) else 0.0
            reward = r if j == len(idx) - 1 else 0.0
            delta = reward + gamma * v_next - v[idx[j]]
            last_gae = delta + gamma * lambd * last_gae
            adv[idx[j]] = last_gae
            ret[idx[j]] = last_gae + v[idx[j]]
        adv_all += adv
        ret_all += ret
    return adv_all, ret_all


@pytest.mark.parametrize("gamma, lambd", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_ppo_gae_skips_masked_positions(gamma, lambd):
    values = [0.2, 9.0, -0.4, 5.0, 5.0, 0.1, 0.3, 7.0, 7.0, -0.5, 6.0]  # masked values must be ignored
    cfg = AlgoConfig(advantage_estimator="ppo", gamma=gamma, lambd=lambd)
    adv, ret = _run(cfg, values=torch.tensor(values))
    want_adv, want_ret = _gae_reference(values, gamma, lambd)
    assert adv == pytest.approx(want_adv, abs=1e-6)
    assert ret == pytest.approx(want_ret, abs=1e-6)


def test_ppo_with_gamma_lambda_one_returns_equal_reward():
    # With γ = λ = 1 the return at every trainable token is the terminal reward, whatever V is.
    cfg = AlgoConfig(advantage_estimator="ppo")
    _, ret = _run(cfg, values=torch.randn(11))
    rewards_per_token = [r for r, n in zip(REWARDS, LENGTHS, strict=True) for _ in range(n)]
    assert ret == pytest.approx([r * m for r, m in zip(rewards_per_token, MASK, strict=True)], abs=1e-6)


@pytest.mark.parametrize("discount", [0.0, 0.5, 0.99, 1.0])
def test_chunked_scan_equals_backward_loop_across_chunks(discount):
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = discounted_reverse_cumsum(x, discount)
    want = torch.zeros_like(x)
    for b in range(3):
        g = 0.0
        for t in reversed(range(300)):
            g = x[b, t].item() + discount * g
            want[b, t] = g
    assert torch.allclose(got, want, atol=1e-9)


def test_opd_penalty_applies_after_estimator_and_before_whitening():
    teacher = [lp - 0.5 * (i % 3) for i, lp in enumerate(LOGP)]
    base = dict(advantage_estimator="grpo", use_opd=True, opd_kl_coef=0.5)
    adv, ret = _run(AlgoConfig(**base), log_probs=torch.tensor(LOGP), teacher_log_probs=torch.tensor(teacher))
    raw = [1.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 0.0]
    want = [(a - 0.5 * (s - t)) if m else 0.0 for a, s, t, m in zip(raw, LOGP, teacher, MASK, strict=True)]
    assert adv == pytest.approx(want, abs=1e-6)
    assert ret == pytest.approx(raw)  # returns are the estimator's, not penalised
    adv_w, _ = _run(
        AlgoConfig(**base, normalize_advantages=True),
        log_probs=torch.tensor(LOGP),
        teacher_log_probs=torch.tensor(teacher),
    )
    assert adv_w == pytest.approx(_whiten_ref(want, MASK), abs=1e-5)


def test_apply_opd_uses_the_top_k_estimate_as_the_baseline_of_the_sampled_term():
    adv = torch.tensor([1.0, 2.0])
    got = apply_opd(
        adv,
        student_log_probs=torch.tensor([-1.0, -1.0]),
        teacher_log_probs=torch.tensor([-3.0, -3.0]),
        opd_reverse_kl=torch.tensor([0.25, -0.5]),
        coef=2.0,
    )
    assert got.tolist() == pytest.approx([1 - 2 * (2 - 0.25), 2 - 2 * (2 + 0.5)])
    with pytest.raises(ValueError, match="teacher"):
        apply_opd(adv, student_log_probs=adv, coef=1.0)
    with pytest.raises(ValueError, match="baseline"):  # a top-K estimate alone carries no action's signal
        apply_opd(adv, student_log_probs=None, opd_reverse_kl=adv, coef=1.0)


def test_opd_advantages_follow_the_reverse_kl_gradient():
    """REINFORCE with the OPD advantages of sampled tokens estimates -grad KL(student || teacher); the
    position's KL alone as the penalty (it does not depend on the sampled token) estimates nothing."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.tensor([0.5, -0.2, 1.0, 0.0, -1.0], requires_grad=True)
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 0.5, 0.0]), -1)
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - teacher)).sum()
    (true_grad,) = torch.autograd.grad(-kl, theta)
    p = logp.detach().exp()
    actions = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    score = torch.nn.functional.one_hot(actions, 5).float() - p  # grad of log p(a) w.r.t. theta
    zeros = torch.zeros(len(actions))
    exact_kl = torch.full_like(zeros, float(kl.detach()))
    with_baseline = apply_opd(
        zeros, student_log_probs=logp.detach()[actions], teacher_log_probs=teacher[actions],
        opd_reverse_kl=exact_kl, coef=1.0,
    )  # fmt: skip
    estimate = (with_baseline[:, None] * score).mean(0)
    assert torch.nn.functional.cosine_similarity(estimate, true_grad, dim=0) > 0.99
    assert (estimate - true_grad).norm() < 0.05 * true_grad.norm()
    position_only = ((-exact_kl)[:, None] * score).mean(0)  # the estimate as the penalty itself
    assert position_only.norm() < 0.05 * true_grad.norm()


def test_masked_whiten_shift_mean_false_keeps_mean():
    x = torch.tensor([1.0, 2.0, 100.0, 5.0])
    m = torch.tensor([1.0, 1.0, 0.0, 1.0])
    mean = 8.0 / 3
    std = math.sqrt(((1 - mean) ** 2 + (2 - mean) ** 2 + (5 - mean) ** 2) / 3 + 1e-8)
    got = masked_whiten(x, m, shift_mean=False).tolist()
    assert got == pytest.approx([(1 - mean) / std + mean, (2 - mean) / std + mean, 0.0, (5 - mean) / std + mean])
    assert masked_whiten(x, torch.zeros(4)).tolist() == [0.0] * 4


def test_zero_length_only_batch():
    cfg = AlgoConfig(advantage_estimator="reinforce_plus_plus", normalize_advantages=True)
    adv, ret = compute_advantages_and_returns(
        cfg, rewards=torch.tensor([1.0, 2.0]), response_lengths=[0, 0], loss_mask=torch.zeros(0)
    )
    assert adv.shape == (0,) and ret.shape == (0,)
    cfg = AlgoConfig(advantage_estimator="ppo")
    adv, _ = compute_advantages_and_returns(
        cfg, rewards=torch.tensor([1.0]), response_lengths=[0], loss_mask=torch.zeros(0), values=torch.zeros(0)
    )
    assert adv.shape == (0,)


def test_config_errors():
    with pytest.raises(ValueError, match="needs --normalize-advantages"):
        check_algo_config(AlgoConfig(advantage_estimator="reinforce_plus_plus"))
    with pytest.raises(ValueError, match="ppo does not shape"):
        check_algo_config(AlgoConfig(advantage_estimator="ppo", kl_coef=0.1))
    with pytest.raises(ValueError, match="both non-zero"):
        check_algo_config(AlgoConfig(kl_coef=0.1, use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="eps-clip-c"):
        check_algo_config(AlgoConfig(eps_clip_c=0.5))
    with pytest.raises(ValueError, match="critic values"):
        _run(AlgoConfig(advantage_estimator="ppo"))
    with pytest.raises(ValueError, match="ref_log_probs"):
        _run(AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1, normalize_advantages=True))
