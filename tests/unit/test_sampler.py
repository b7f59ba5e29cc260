"""Batched sampler: log-prob convention, truncation rules, greedy rows, per-request generators."""

import numpy as np
import pytest
import torch

from miles.engines.embedded.sampler import SamplingBatch, SamplingParams, sample, token_logprobs
from miles.engines.embedded.transfer import to_device

torch.set_num_threads(1)


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_logprob_is_of_sampled_token_under_temperature_scaled_distribution():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32) * 3
    temps = [0.5, 1.0, 1.7, 0.0, 0.9]
    params = [SamplingParams(temperature=t) for t in temps]
    tokens, lps = sample(torch.from_numpy(logits), params, [None] * 5, torch.Generator().manual_seed(0))
    for i, t in enumerate(temps):
        expected = _np_log_softmax(logits[i] / (t if t > 0 else 1.0))[tokens[i]]
        assert abs(lps[i].item() - expected) < 1e-5
    assert tokens[3].item() == int(np.argmax(logits[3]))  # temperature 0 = greedy


def test_truncation_keeps_only_allowed_tokens_and_matches_renormalised_distribution():
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.from_numpy(np.log(probs).astype(np.float32))
    cases = [  # (params, tokens the rule keeps, computed by hand)
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.7), [0, 1, 2]),  # cumulative before token 2 is 0.65 < 0.7: kept
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # threshold 0.3 * 0.4 = 0.12
        (SamplingParams(top_k=3, top_p=0.5), [0, 1]),
    ]
    n = 20000
    for params, kept in cases:
        batch = logits[None].expand(n, -1).contiguous()
        tokens, _ = sample(batch, [params] * n, [None] * n, torch.Generator().manual_seed(1))
        counts = np.bincount(tokens.numpy(), minlength=len(probs)) / n
        expected = np.zeros_like(probs)
        expected[kept] = probs[kept] / probs[kept].sum()
        assert set(np.nonzero(counts)[0]) <= set(kept), (params, counts)
        sigma = np.sqrt(expected * (1 - expected) / n)
        assert np.all(np.abs(counts - expected) <= 5 * sigma + 1e-9), (params, counts, expected)


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    tokens, _ = sample(logits, params, [None] * 3, torch.Generator().manual_seed(0))
    assert tokens[0].item() == 1 and tokens[2].item() == 2


def test_request_generator_makes_samples_independent_of_batch_neighbours():
    rng = np.random.default_rng(2)
    row = torch.from_numpy(rng.normal(size=(1, 50)).astype(np.float32))
    others = torch.from_numpy(rng.normal(size=(7, 50)).astype(np.float32))
    p = SamplingParams(temperature=1.0)

    def draw(batch: torch.Tensor, index: int) -> list[int]:
        gen = torch.Generator().manual_seed(123)
        out = []
        for _ in range(10):
            gens = [gen if i == index else None for i in range(batch.shape[0])]
            tokens, _ = sample(batch, [p] * batch.shape[0], gens, torch.Generator().manual_seed(len(out)))
            out.append(tokens[index].item())
        return out

    alone = draw(row, 0)
    in_batch = draw(torch.cat([others[:3], row, others[3:]]), 3)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_token_logprobs_matches_numpy():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 9)).astype(np.float32)
    targets = np.array([1, 8, 0, 4])
    got = token_logprobs(torch.from_numpy(logits), torch.from_numpy(targets), 0.8).numpy()
    expected = _np_log_softmax(logits / 0.8)[np.arange(4), targets]
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": 0},
        {"max_new_tokens": -1},
        {"n": 0},
        {"min_p": 2},
        {"no_such_param": 1},
    ],
)
def test_bad_sampling_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(bad)


def test_sampling_params_accept_sglang_payload():
    p = SamplingParams.from_dict(
        {
            "temperature": 0.7,
            "stop": "##",
            "stop_token_ids": [2],
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
    )
    assert p.stop == ["##"] and p.stop_token_ids == [2] and p.no_stop_trim


def test_a_batch_builds_its_truncation_limits_once_and_only_those_it_uses():
    """The limits are device tensors made once per batch (a decode step reuses them: on CUDA each build
    was a copy the host waited for), with None for a limit no row uses; rows without top-k keep all."""
    batch = SamplingBatch([SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams()])
    limits = batch.truncation(torch.device("cpu"), 10)
    assert batch.truncation(torch.device("cpu"), 10) is limits
    assert limits.top_k.tolist() == [3, 10, 10] and limits.top_k.dtype == torch.long
    assert limits.top_p.tolist() == [1.0, 0.5, 1.0] and limits.min_p is None
    torch.manual_seed(0)
    tokens, _ = sample(torch.randn(3, 10), batch, [None] * 3)
    assert tokens.shape == (3,)


def test_to_device_keeps_values_and_dtypes():
    assert to_device([[1, 2], [3, 4]], "cpu").tolist() == [[1, 2], [3, 4]]
    assert to_device([0.5, 2.0], torch.device("cpu"), torch.float32).dtype == torch.float32
    assert to_device([True, False], "cpu", torch.bool).tolist() == [True, False]
    assert to_device(torch.tensor([1, 2], dtype=torch.int32), "cpu").dtype == torch.long


def test_the_scheduler_reuses_a_batch_and_compares_later_steps_by_identity(monkeypatch):
    """A new round's requests carry new but equal parameters: their batch is reused, and the steps after
    the first compare the same objects again, not 256 dataclasses field by field every step."""
    from miles.engines.embedded.step_sampling import StepSampling

    compared = []
    field_eq = SamplingParams.__eq__
    monkeypatch.setattr(SamplingParams, "__eq__", lambda a, b: compared.append(1) or field_eq(a, b))
    sampling = StepSampling(runner=None, batch_generator=None)  # sampling batches need neither
    first_round = [SamplingParams(top_p=0.5) for _ in range(4)]
    batch = sampling.sampling_batch(list(first_round))
    second_round = [SamplingParams(top_p=0.5) for _ in range(4)]
    assert sampling.sampling_batch(list(second_round)) is batch and len(compared) == 4
    for _ in range(3):  # the decode steps of the second round
        assert sampling.sampling_batch(list(second_round)) is batch
    assert len(compared) == 4
    assert sampling.sampling_batch([SamplingParams(top_p=0.9)] * 4) is not batch
