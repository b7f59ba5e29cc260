"""Dynamic sampling filters and the bare-bool normalisation of plug-in results."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.rollout.filters import DynamicFilterOutput, apply_filter, check_no_aborted, check_reward_nonzero_std
from miles.rollout.sample import Sample, SampleStatus

ARGS = SimpleNamespace(reward_key=None)


def _group(*rewards, status=SampleStatus.COMPLETED) -> list[Sample]:
    return [Sample(reward=r, status=status, group_index=0) for r in rewards]


def test_nonzero_std_keeps_mixed_groups() -> None:
    assert check_reward_nonzero_std(ARGS, _group(1.0, 0.0, 0.0, 0.0)) == DynamicFilterOutput(True, None)


@pytest.mark.parametrize(
    ("rewards", "reason"), [((1.0, 1.0, 1.0), "zero_std_1.0"), ((0.0, 0.0), "zero_std_0.0"), ((0.26,), "zero_std_0.3")]
)
def test_nonzero_std_drops_flat_and_singleton_groups(rewards, reason) -> None:
    assert check_reward_nonzero_std(ARGS, _group(*rewards)) == DynamicFilterOutput(False, reason)


def test_nonzero_std_uses_reward_key_and_nested_groups() -> None:
    args = SimpleNamespace(reward_key="acc")
    flat = [Sample(reward={"acc": 1.0, "fmt": 0.0}), Sample(reward={"acc": 1.0, "fmt": 1.0})]
    assert not check_reward_nonzero_std(args, flat).keep  # differs only on the unused key
    nested = [[Sample(reward={"acc": 0.0})], [Sample(reward={"acc": 1.0}), Sample(reward={"acc": 1.0})]]
    assert check_reward_nonzero_std(args, nested).keep


def test_no_aborted() -> None:
    group = _group(1.0, 0.0)
    assert check_no_aborted(ARGS, group).keep
    group[1].status = SampleStatus.ABORTED
    assert check_no_aborted(ARGS, group) == DynamicFilterOutput(False, "aborted")


def test_apply_filter_accepts_bare_bool_and_rejects_other_types() -> None:
    group = _group(1.0, 0.0)
    assert apply_filter(lambda args, g: True, ARGS, group) == DynamicFilterOutput(True, None)
    assert apply_filter(lambda args, g: False, ARGS, group) == DynamicFilterOutput(False, "filtered")
    assert apply_filter(check_no_aborted, ARGS, group).keep
    with pytest.raises(TypeError, match="return a bool or DynamicFilterOutput"):
        apply_filter(lambda args, g: 1, ARGS, group)
