"""TIS (clamp) and clip-or-pop weights, their metrics, and their effect on the policy loss."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from miles.algo.aggregation import StepDenominators
from miles.algo.corrections import load_correction, tis_weights
from miles.algo.losses import LossInputs, policy_loss
from miles.config import AlgoConfig

torch.set_num_threads(1)

# old − rollout log ratios: ratios e^1.0 = 2.718 (above 2), e^0.5 = 1.649, 1, e^-3 = 0.0498, masked e^2.
OLD = [-1.0, -1.0, -1.0, -4.0, -1.0]
ROLLOUT = [-2.0, -1.5, -1.0, -1.0, -3.0]
MASK = [1.0, 1.0, 1.0, 1.0, 0.0]
RATIOS = [math.exp(o - r) for o, r in zip(OLD, ROLLOUT, strict=True)]


def _t(xs):
    return torch.tensor(xs, dtype=torch.float32)


def test_clamp_mode_weights_and_info():
    w, info = tis_weights(_t(OLD), _t(ROLLOUT), _t(MASK), lo=0.1, hi=2.0, mode="clamp")
    want = [min(max(r, 0.1), 2.0) * m for r, m in zip(RATIOS, MASK, strict=True)]
    assert w.tolist() == pytest.approx(want, rel=1e-6)
    assert info["ratio"].tolist() == pytest.approx([r * m for r, m in zip(RATIOS, MASK, strict=True)], rel=1e-6)
    assert info["clipped"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]  # the masked outlier is not counted
    assert info["abs_dev"].tolist() == pytest.approx(
        [abs(r - 1) * m for r, m in zip(RATIOS, MASK, strict=True)], rel=1e-6
    )


def test_clip_or_pop_zeroes_outside_and_passes_ratio_inside():
    w, info = tis_weights(_t(OLD), _t(ROLLOUT), _t(MASK), lo=0.1, hi=2.0, mode="clip_or_pop")
    assert w.tolist() == pytest.approx([0.0, RATIOS[1], 1.0, 0.0, 0.0], rel=1e-6)
    assert info["clipped"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("mode", ["clamp", "clip_or_pop"])
def test_ratio_exactly_on_bounds_is_kept(mode):
    r_hi = torch.exp(torch.tensor(0.5)).item()
    old, rollout = _t([0.5, 0.0, 0.0]), _t([0.0, 0.0, 0.0])
    w, info = tis_weights(old, rollout, torch.ones(3), lo=1.0, hi=r_hi, mode=mode)
    assert w.tolist() == [r_hi, 1.0, 1.0]
    assert info["clipped"].tolist() == [0.0, 0.0, 0.0]


def test_default_interval_only_acts_on_upper_tail():
    w, info = tis_weights(_t([-10.0, 3.0]), _t([0.0, 0.0]), torch.ones(2), lo=0.0, hi=2.0, mode="clamp")
    assert w.tolist() == pytest.approx([math.exp(-10.0), 2.0], rel=1e-6)
    assert info["clipped"].tolist() == [0.0, 1.0]


def test_weights_carry_no_gradient_and_bad_inputs_raise():
    old = _t(OLD).requires_grad_()
    w, _ = tis_weights(old, _t(ROLLOUT), _t(MASK), lo=0.0, hi=2.0, mode="clamp")
    assert not w.requires_grad
    with pytest.raises(ValueError, match="--tis-clip-low"):
        tis_weights(_t(OLD), _t(ROLLOUT), _t(MASK), lo=3.0, hi=2.0, mode="clamp")
    with pytest.raises(ValueError, match="--tis-mode"):
        tis_weights(_t(OLD), _t(ROLLOUT), _t(MASK), lo=0.0, hi=2.0, mode="truncate")


@pytest.mark.parametrize("mode", ["clamp", "clip_or_pop"])
def test_policy_loss_with_tis_weights_and_metrics(mode):
    # new == old so the PPO ratio is 1 and the per-token pg loss is just −A; TIS weights it.
    adv = [1.0, -2.0, 0.5, 3.0, 7.0]
    cfg = AlgoConfig(use_tis=True, tis_mode=mode, tis_clip_low=0.1, tis_clip=2.0)
    inp = LossInputs(
        _t(OLD),
        _t(MASK),
        [2, 3],
        StepDenominators(2, 4),
        old_log_probs=_t(OLD),
        advantages=_t(adv),
        rollout_log_probs=_t(ROLLOUT),
    )
    loss, metrics = policy_loss(cfg, inp)
    if mode == "clamp":
        weights = [min(max(r, 0.1), 2.0) for r in RATIOS]
    else:
        weights = [r if 0.1 <= r <= 2.0 else 0.0 for r in RATIOS]
    per_token = [-a * w * m for a, w, m in zip(adv, weights, MASK, strict=True)]

    def smean(xs):  # samples [0, 1] (2 active tokens) and [2, 3, 4] (2 active tokens)
        return ((xs[0] + xs[1]) / 2 + (xs[2] * MASK[2] + xs[3] * MASK[3] + xs[4] * MASK[4]) / 2) / 2

    assert loss.item() == pytest.approx(smean(per_token), rel=1e-6)
    assert metrics["tis"].item() == pytest.approx(smean(RATIOS), rel=1e-6)
    assert metrics["tis_abs"].item() == pytest.approx(smean([abs(r - 1) for r in RATIOS]), rel=1e-6)
    assert metrics["tis_clipfrac"].item() == pytest.approx(smean([1.0, 0.0, 0.0, 1.0, 0.0]))
    diffs = [abs(o - r) for o, r in zip(OLD, ROLLOUT, strict=True)]
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(smean(diffs), rel=1e-6)
    # low_var_kl(rollout, old): u = old − rollout, e^u − 1 − u, clamped to [−10, 10].
    lvk = [min(math.exp(o - r) - 1 - (o - r), 10.0) for o, r in zip(OLD, ROLLOUT, strict=True)]
    assert metrics["train_rollout_kl"].item() == pytest.approx(smean(lvk), rel=1e-5)


def test_use_tis_without_rollout_log_probs_raises():
    cfg = AlgoConfig(use_tis=True)
    inp = LossInputs(_t(OLD), _t(MASK), [5], StepDenominators(1, 4), old_log_probs=_t(OLD), advantages=_t(OLD))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss(cfg, inp)


def test_load_correction_builtin_and_custom(tmp_path, monkeypatch):
    fn = load_correction(AlgoConfig(tis_mode="clip_or_pop", tis_clip_low=0.5, tis_clip=1.5))
    w, _ = fn(_t([0.0, 1.0]), _t([0.0, 0.0]), torch.ones(2))
    assert w.tolist() == [1.0, 0.0]
    (tmp_path / "my_tis_mod.py").write_text(
        textwrap.dedent("""
        import torch
        def half(old, rollout, mask, *, lo, hi):
            return torch.full_like(old, 0.5) * mask, {"bounds": torch.tensor([lo, hi])}
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = AlgoConfig(use_tis=True, custom_tis_function_path="my_tis_mod:half", tis_clip_low=0.2, tis_clip=3.0)
    w, info = load_correction(cfg)(_t(OLD), _t(ROLLOUT), _t(MASK))
    assert w.tolist() == [0.5, 0.5, 0.5, 0.5, 0.0] and info["bounds"].tolist() == pytest.approx([0.2, 3.0])
    # Through the loss: no per-token info from the plug-in, so tis is computed from the ratio itself.
    inp = LossInputs(
        _t(OLD),
        _t(MASK),
        [5],
        StepDenominators(1, 4),
        old_log_probs=_t(OLD),
        advantages=torch.ones(5),
        rollout_log_probs=_t(ROLLOUT),
    )
    loss, metrics = policy_loss(cfg, inp)
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["tis"].item() == pytest.approx(sum(RATIOS[:4]) / 4, rel=1e-6)
    sys.modules.pop("my_tis_mod", None)
