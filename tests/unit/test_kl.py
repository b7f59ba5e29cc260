"""KL estimators against their closed forms computed with the math module."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.kl import compute_approx_kl

torch.set_num_threads(1)

LOGP = [-0.5, -2.0, -1.0, -3.0]
REF = [-1.0, -1.5, -1.0, -0.2]


def _delta():
    return [a - b for a, b in zip(LOGP, REF, strict=True)]


@pytest.mark.parametrize(
    "kl_type, fn",
    [
        ("k1", lambda d: d),
        ("k2", lambda d: d * d / 2),
        ("k3", lambda d: math.exp(-d) - 1 + d),
        # The last token's k3 is 12.64: low_var_kl clamps it to 10.
        ("low_var_kl", lambda d: min(math.exp(-d) - 1 + d, 10.0)),
    ],
)
def test_estimators_match_closed_form(kl_type, fn):
    got = compute_approx_kl(torch.tensor(LOGP), torch.tensor(REF), kl_type)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([fn(d) for d in _delta()], rel=1e-5, abs=1e-7)


def test_identical_policies_give_zero_for_every_estimator():
    lp = torch.tensor([-0.3, -4.0, -0.01])
    for kl_type in ("k1", "k2", "k3", "low_var_kl"):
        assert compute_approx_kl(lp, lp.clone(), kl_type).abs().max().item() == 0.0


def test_low_var_kl_clamps_where_k3_explodes():
    lp = torch.tensor([-40.0, 0.0, float("nan")])
    ref = torch.tensor([0.0, -40.0, -1.0])
    k3 = compute_approx_kl(lp, ref, "k3")
    assert k3[0].item() > 1e16  # e^40 unclamped
    low = compute_approx_kl(lp, ref, "low_var_kl")
    # u = ref - lp = 40 -> clamped to 20 -> e^20 - 21 -> result clamped to 10.
    assert low[0].item() == 10.0
    # u = -40 -> clamped to -20 -> e^-20 - 1 + 20 ≈ 19 -> clamped to 10.
    assert low[1].item() == 10.0
    # NaN difference is cleaned to u = 0 -> 0.
    assert low[2].item() == 0.0


def test_bf16_inputs_are_computed_in_fp32():
    lp = torch.tensor([-1.0], dtype=torch.bfloat16)
    ref = torch.tensor([-1.125], dtype=torch.bfloat16)  # exactly representable in bf16
    got = compute_approx_kl(lp, ref, "k3")
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(math.exp(-0.125) - 1 + 0.125, rel=1e-6)


def test_unknown_type_and_shape_mismatch_raise():
    with pytest.raises(ValueError, match="--kl-loss-type"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="differ"):
        compute_approx_kl(torch.zeros(2), torch.zeros(3), "k1")
