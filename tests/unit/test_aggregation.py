"""Aggregation modes against a plain Python loop over samples, and exact gradient accumulation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from miles.algo.aggregation import StepDenominators, aggregate, resolve_aggregation, segment_sum

torch.set_num_threads(1)

# Four samples: normal, zero-length, fully masked, partly masked (tool span in the middle).
LENGTHS = [3, 0, 2, 4]
X = [0.5, -1.0, 2.0, 7.0, 9.0, 1.0, 3.0, -2.0, 4.0]
M = [1, 1, 1, 0, 0, 1, 0, 1, 1]


def _split(values, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(values[start : start + n])
        start += n
    return out


def _reference(x, m, lengths, mode, num_samples, num_tokens):
    xs, ms = _split(x, lengths), _split(m, lengths)
    if mode == "token_mean":
        return sum(a * b for a, b in zip(x, m, strict=True)) / max(num_tokens, 1)
    if mode == "seq_mean_token_sum":
        return (
            sum(sum(a * b for a, b in zip(xi, mi, strict=True)) for xi, mi in zip(xs, ms, strict=True)) / num_samples
        )
    total = 0.0
    for xi, mi in zip(xs, ms, strict=True):
        total += sum(a * b for a, b in zip(xi, mi, strict=True)) / max(sum(mi), 1)
    return total / num_samples


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "seq_mean_token_sum"])
def test_modes_match_python_loop(mode):
    den = StepDenominators(num_samples=8, num_tokens=11)  # the step is larger than this micro-batch
    got = aggregate(torch.tensor(X), torch.tensor(M, dtype=torch.float32), LENGTHS, mode, den)
    want = _reference(X, M, LENGTHS, mode, 8, 11)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_sample_mean_hand_value():
    # sample 0: (0.5 - 1 + 2)/3 = 0.5; sample 1: empty; sample 2: masked -> 0; sample 3: (3 + 4 - 2... masked 3) = (1 - 2 + 4)/3 = 1
    got = aggregate(
        torch.tensor(X), torch.tensor(M, dtype=torch.float32), LENGTHS, "sample_mean", StepDenominators(4, 6)
    )
    assert got.item() == pytest.approx((0.5 + 0.0 + 0.0 + 1.0) / 4)


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "seq_mean_token_sum"])
def test_micro_batch_sum_equals_step_objective(mode):
    """Splitting the step into micro-batches and summing contributions gives the whole-step value."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 0, 3, 7, 1, 4]
    x = torch.randn(sum(lengths), generator=gen)
    m = (torch.rand(sum(lengths), generator=gen) > 0.3).float()
    den = StepDenominators(num_samples=len(lengths), num_tokens=int(m.sum().item()))
    whole = aggregate(x, m, lengths, mode, den)
    parts, start = [], 0
    for chunk in ([5, 0], [3], [7, 1, 4]):
        n = sum(chunk)
        parts.append(aggregate(x[start : start + n], m[start : start + n], chunk, mode, den))
        start += n
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
    want = _reference(x.tolist(), m.tolist(), lengths, mode, den.num_samples, den.num_tokens)
    assert whole.item() == pytest.approx(want, rel=1e-5)


def test_nan_on_masked_tokens_contributes_zero_and_gradient_is_clean():
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf")], requires_grad=True)
    m = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out = aggregate(x, m, [2, 2], "sample_mean", StepDenominators(2, 2))
    assert out.item() == pytest.approx((1.0 / 1 + 3.0 / 1) / 2)
    out.backward()
    assert torch.equal(x.grad, torch.tensor([0.5, 0.0, 0.5, 0.0]))


def test_sample_mean_gradient_is_mask_over_sample_tokens_over_num_samples():
    x = torch.zeros(5, requires_grad=True)
    m = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    aggregate(x, m, [3, 2], "sample_mean", StepDenominators(num_samples=4, num_tokens=4)).backward()
    want = [1 / 2 / 4, 1 / 2 / 4, 0.0, 1 / 2 / 4, 1 / 2 / 4]
    assert x.grad.tolist() == pytest.approx(want)


def test_fully_masked_and_empty_batch_give_zero():
    den = StepDenominators(num_samples=3, num_tokens=0)
    for mode in ("sample_mean", "token_mean", "seq_mean_token_sum"):
        assert aggregate(torch.ones(3), torch.zeros(3), [3, 0, 0], mode, den).item() == 0.0
        assert aggregate(torch.zeros(0), torch.zeros(0), [], mode, den).item() == 0.0


def test_errors_are_specific():
    with pytest.raises(ValueError, match="response_lengths sum to 4"):
        aggregate(torch.ones(3), torch.ones(3), [2, 2], "sample_mean", StepDenominators(2, 3))
    with pytest.raises(ValueError, match="num_samples=1"):
        aggregate(torch.ones(3), torch.ones(3), [2, 1], "sample_mean", StepDenominators(1, 3))
    with pytest.raises(ValueError, match="not one of"):
        aggregate(torch.ones(3), torch.ones(3), [3], "prompt_mean", StepDenominators(1, 3))


def test_resolve_aggregation_defaults():
    ns = SimpleNamespace
    assert resolve_aggregation(ns(loss_aggregation=None, calculate_per_token_loss=False)) == "sample_mean"
    assert resolve_aggregation(ns(loss_aggregation=None, calculate_per_token_loss=True)) == "token_mean"
    assert resolve_aggregation(ns(loss_aggregation="seq_mean_token_sum", calculate_per_token_loss=True)) == (
        "seq_mean_token_sum"
    )


def test_segment_sum_with_empty_segments():
    got = segment_sum(torch.tensor([1.0, 2.0, 3.0]), [0, 2, 0, 1])
    assert got.tolist() == [0.0, 3.0, 0.0, 3.0]
    assert math.isclose(got.sum().item(), 6.0)
