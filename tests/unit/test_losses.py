"""Policy, value and SFT losses against per-token Python references; aggregation and edge cases."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from miles.algo.aggregation import StepDenominators
from miles.algo.losses import LossInputs, get_loss_function, policy_loss, sft_loss, value_loss
from miles.config import AlgoConfig

torch.set_num_threads(1)

LENGTHS = [3, 0, 2, 4]
MASK = [1, 1, 1, 0, 0, 1, 1, 0, 1]
OLD = [-1.0, -0.5, -2.0, -0.7, -0.3, -1.2, -0.9, -0.4, -1.5]
# new − old: 0.1 (r=1.105), 0.5 (r=1.65, clipped high for A>0), −0.5 (r=0.61, clipped low for A<0) ...
NEW = [-0.9, 0.0, -2.5, -0.7, -0.3, -0.2, -1.9, -0.4, -1.4]
ADV = [1.0, 1.0, -1.0, 0.5, 0.5, -2.0, 2.0, 3.0, -1.0]


def _split(values, lengths=LENGTHS):
    out, start = [], 0
    for n in lengths:
        out.append(list(values[start : start + n]))
        start += n
    return out


def _sample_mean(per_token, mask=MASK, lengths=LENGTHS, num_samples=None):
    num_samples = num_samples or len(lengths)
    total = 0.0
    for x, m in zip(_split(per_token, lengths), _split(mask, lengths), strict=True):
        total += sum(a * b for a, b in zip(x, m, strict=True)) / max(sum(m), 1)
    return total / num_samples


def _pg_reference(new, old, adv, mask, el, eh, c=None):
    losses, clip = [], []
    for n, o, a, m in zip(new, old, adv, mask, strict=True):
        if not m:
            losses.append(0.0)
            clip.append(0.0)
            continue
        r = math.exp(max(min(n - o, 20.0), -20.0))
        l1, l2 = -r * a, -min(max(r, 1 - el), 1 + eh) * a
        loss = max(l1, l2)
        if c is not None and a < 0:
            loss = min(loss, -c * a)
        losses.append(loss)
        clip.append(1.0 if l2 > l1 else 0.0)
    return losses, clip


def _inputs(**kw):
    base = dict(
        log_probs=torch.tensor(NEW, requires_grad=True),
        loss_mask=torch.tensor(MASK, dtype=torch.float32),
        response_lengths=LENGTHS,
        den=StepDenominators(num_samples=4, num_tokens=sum(MASK)),
        old_log_probs=torch.tensor(OLD),
        advantages=torch.tensor(ADV),
    )
    base.update(kw)
    return LossInputs(**base)


@pytest.mark.parametrize("eps_high, eps_c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_policy_loss_matches_per_token_reference(eps_high, eps_c):
    cfg = AlgoConfig(eps_clip=0.2, eps_clip_high=eps_high, eps_clip_c=eps_c)
    loss, metrics = policy_loss(cfg, _inputs())
    losses, clip = _pg_reference(NEW, OLD, ADV, MASK, 0.2, eps_high or 0.2, eps_c)
    assert loss.item() == pytest.approx(_sample_mean(losses), rel=1e-6)
    assert metrics["pg_loss"].item() == pytest.approx(_sample_mean(losses), rel=1e-6)
    assert metrics["pg_clipfrac"].item() == pytest.approx(_sample_mean(clip), rel=1e-6)
    assert metrics["ppo_kl"].item() == pytest.approx(
        _sample_mean([o - n for o, n in zip(OLD, NEW, strict=True)]), rel=1e-6
    )
    ois = _sample_mean([math.exp(n - o) for n, o in zip(NEW, OLD, strict=True)])
    assert metrics["ois"].item() == pytest.approx(ois, rel=1e-6)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_dual_clip_bounds_negative_advantage_loss():
    # r = e^1.5 = 4.48, A = −1: unclipped −r·A = 4.48; dual clip c = 3 caps it at 3.
    cfg = AlgoConfig(eps_clip_c=3.0)
    inp = LossInputs(
        torch.tensor([0.0]),
        torch.ones(1),
        [1],
        StepDenominators(1, 1),
        old_log_probs=torch.tensor([-1.5]),
        advantages=torch.tensor([-1.0]),
    )
    assert policy_loss(cfg, inp)[0].item() == pytest.approx(3.0)
    assert policy_loss(AlgoConfig(), inp)[0].item() == pytest.approx(math.exp(1.5), rel=1e-6)


def test_gradient_flows_only_through_unclipped_tokens():
    # Sample 0 token 0: r = e^0.1 inside the clip, A = 1 -> dL/dlogp = −r·A / (3 tokens · 4 samples).
    # Token 1: r = e^0.5 > 1.2 with A > 0 -> clipped, zero gradient.
    inp = _inputs()
    policy_loss(AlgoConfig(), inp)[0].backward()
    grad = inp.log_probs.grad.tolist()
    assert grad[0] == pytest.approx(-math.exp(0.1) / 3 / 4, rel=1e-6)
    assert grad[1] == 0.0
    assert grad[3] == 0.0 and grad[4] == 0.0  # fully masked sample


def test_ratio_exactly_at_clip_edges_is_not_clipped():
    r_hi = torch.exp(torch.tensor(0.25)).item()  # float32 ratio; make 1 + eps_high hit it exactly
    r_lo = torch.exp(torch.tensor(-0.25)).item()
    cfg = AlgoConfig(eps_clip=1.0 - r_lo, eps_clip_high=r_hi - 1.0)
    inp = LossInputs(
        torch.tensor([0.25, -0.25, 0.0]),
        torch.ones(3),
        [3],
        StepDenominators(1, 3),
        old_log_probs=torch.zeros(3),
        advantages=torch.tensor([2.0, -2.0, 1.0]),
    )
    loss, metrics = policy_loss(cfg, inp)
    assert metrics["pg_clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx((-r_hi * 2.0 + r_lo * 2.0 - 1.0) / 3, rel=1e-6)
    # eps = 0: ratio 1 sits on both edges at once.
    inp.log_probs = torch.zeros(3)
    loss, metrics = policy_loss(AlgoConfig(eps_clip=0.0), inp)
    assert metrics["pg_clipfrac"].item() == 0.0 and loss.item() == pytest.approx(-1.0 / 3)


def test_gspo_uses_sequence_mean_log_ratio():
    cfg = AlgoConfig(advantage_estimator="gspo", eps_clip=10.0)  # wide clip: pure sequence-ratio surrogate
    loss, metrics = policy_loss(cfg, _inputs())
    want_tokens = []
    for n, o, a, m in zip(_split(NEW), _split(OLD), _split(ADV), _split(MASK), strict=True):
        k = sum(mi for mi in m)
        seq = sum((ni - oi) * mi for ni, oi, mi in zip(n, o, m, strict=True)) / max(k, 1)
        want_tokens += [-math.exp(seq) * ai if mi else 0.0 for ai, mi in zip(a, m, strict=True)]
    assert loss.item() == pytest.approx(_sample_mean(want_tokens), rel=1e-6)


def test_token_mean_and_entropy_and_kl_terms():
    entropy = [0.5, 1.0, 1.5, 9.0, 9.0, 2.0, 0.1, 9.0, 0.3]
    ref = [-1.1, -0.1, -2.0, 0.0, 0.0, -0.5, -1.0, 0.0, -1.0]
    cfg = AlgoConfig(
        calculate_per_token_loss=True, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3"
    )
    den = StepDenominators(num_samples=4, num_tokens=10)
    loss, metrics = policy_loss(cfg, _inputs(den=den, entropy=torch.tensor(entropy), ref_log_probs=torch.tensor(ref)))
    losses, _ = _pg_reference(NEW, OLD, ADV, MASK, 0.2, 0.2)

    def tok(xs):
        return sum(x * m for x, m in zip(xs, MASK, strict=True)) / 10

    kl = [math.exp(r - n) - 1 - (r - n) for n, r in zip(NEW, ref, strict=True)]
    assert metrics["entropy_loss"].item() == pytest.approx(tok(entropy), rel=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(tok(kl), rel=1e-5)
    assert loss.item() == pytest.approx(tok(losses) - 0.01 * tok(entropy) + 0.1 * tok(kl), rel=1e-5)


def test_micro_batches_sum_to_whole_step():
    cfg = AlgoConfig()
    whole, wm = policy_loss(cfg, _inputs())
    first = _inputs(
        log_probs=torch.tensor(NEW[:3]),
        loss_mask=torch.tensor(MASK[:3], dtype=torch.float32),
        response_lengths=[3, 0],
        old_log_probs=torch.tensor(OLD[:3]),
        advantages=torch.tensor(ADV[:3]),
    )
    second = _inputs(
        log_probs=torch.tensor(NEW[3:]),
        loss_mask=torch.tensor(MASK[3:], dtype=torch.float32),
        response_lengths=[2, 4],
        old_log_probs=torch.tensor(OLD[3:]),
        advantages=torch.tensor(ADV[3:]),
    )
    (l1, m1), (l2, m2) = policy_loss(cfg, first), policy_loss(cfg, second)
    assert (l1 + l2).item() == pytest.approx(whole.item(), rel=1e-6)
    assert (m1["pg_clipfrac"] + m2["pg_clipfrac"]).item() == pytest.approx(wm["pg_clipfrac"].item(), rel=1e-6)


def test_nan_in_masked_and_empty_samples_is_harmless():
    new = torch.tensor([float("nan"), float("-inf"), -1.0], requires_grad=True)
    inp = LossInputs(
        new,
        torch.tensor([0.0, 0.0, 1.0]),
        [2, 0, 1],
        StepDenominators(3, 1),
        old_log_probs=torch.tensor([float("nan"), -1.0, -1.0]),
        advantages=torch.tensor([float("inf"), 1.0, 2.0]),
    )
    loss, metrics = policy_loss(AlgoConfig(), inp)
    assert loss.item() == pytest.approx(-2.0 / 3)
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad[:2].tolist() == [0.0, 0.0]
    assert all(torch.isfinite(v) for v in metrics.values())


def test_value_loss_hand_computed():
    # token 0: V=1.5, V_old=1.0, R=2.0 -> clip V to 1.2: (1.2-2)^2=0.64 > (1.5-2)^2=0.25 -> 0.64, clipped
    # token 1: V=0.1, V_old=0.0, R=1.0 -> inside clip: 0.81
    # token 2: masked. token 3: V=-1, V_old=0, R=-2 -> clip -0.2: (1.8)^2=3.24 > 1 -> 3.24, clipped
    inp = LossInputs(
        torch.zeros(4),
        torch.tensor([1.0, 1.0, 0.0, 1.0]),
        [3, 1],
        StepDenominators(2, 3),
        values=torch.tensor([1.5, 0.1, 5.0, -1.0], requires_grad=True),
        old_values=torch.tensor([1.0, 0.0, 0.0, 0.0]),
        returns=torch.tensor([2.0, 1.0, 0.0, -2.0]),
    )
    loss, metrics = value_loss(AlgoConfig(value_clip=0.2), inp)
    assert loss.item() == pytest.approx(((0.64 + 0.81) / 2 + 3.24) / 2, rel=1e-6)
    assert metrics["value_clipfrac"].item() == pytest.approx((1 / 2 + 1) / 2)
    loss.backward()
    assert inp.values.grad.tolist()[0] == 0.0  # clipped branch carries no gradient to V
    assert inp.values.grad.tolist()[1] == pytest.approx(2 * (0.1 - 1.0) / 2 / 2, rel=1e-6)


def test_sft_loss_is_masked_nll():
    inp = LossInputs(
        torch.tensor([-1.0, -3.0, -2.0, -4.0]), torch.tensor([1.0, 0.0, 1.0, 1.0]), [2, 2], StepDenominators(2, 3)
    )
    loss, metrics = sft_loss(AlgoConfig(), inp)
    assert loss.item() == pytest.approx((1.0 + 3.0) / 2)
    loss_tok, _ = sft_loss(AlgoConfig(calculate_per_token_loss=True), inp)
    assert loss_tok.item() == pytest.approx(7.0 / 3)


def test_get_loss_function_builtin_custom_and_errors(tmp_path, monkeypatch):
    assert get_loss_function(AlgoConfig()) is policy_loss
    assert get_loss_function(AlgoConfig(loss_type="sft_loss")) is sft_loss
    assert get_loss_function(AlgoConfig(loss_type="value_loss")) is value_loss
    (tmp_path / "my_loss_mod.py").write_text(
        textwrap.dedent("""
        def my_loss(cfg, inp):
            loss = inp.log_probs.sum() * 0
            return loss, {"loss": loss.detach()}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_loss_function(AlgoConfig(loss_type="custom_loss", custom_loss_function_path="my_loss_mod:my_loss"))
    assert fn(AlgoConfig(), _inputs())[0].item() == 0.0
    sys.modules.pop("my_loss_mod", None)
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        get_loss_function(AlgoConfig(loss_type="custom_loss"))
    with pytest.raises(ValueError, match="not one of"):
        get_loss_function(AlgoConfig(loss_type="dpo"))
    with pytest.raises(ValueError, match="old_log_probs"):
        policy_loss(AlgoConfig(), _inputs(old_log_probs=None))
