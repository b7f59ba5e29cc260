import pytest

from miles.weights.p2p import format_plan, plan_transfers


@pytest.mark.parametrize(
    ("sources", "targets", "expected"),
    [
        (1, 4, {0: [0, 1, 2, 3]}),  # one sender serves everyone
        (4, 1, {0: [0]}),  # surplus sources idle
        (3, 5, {0: [0, 3], 1: [1, 4], 2: [2]}),  # 3 pairs, then 3->s0, 4->s1
        (8, 8, {i: [i] for i in range(8)}),  # one to one
    ],
)
def test_plan_matches_rule(sources, targets, expected):
    assert plan_transfers(sources, targets) == expected


@pytest.mark.parametrize(("sources", "targets"), [(1, 1), (2, 7), (5, 3), (4, 13), (16, 64)])
def test_plan_properties(sources, targets):
    plan = plan_transfers(sources, targets)
    paired = min(sources, targets)
    assert sorted(t for ts in plan.values() for t in ts) == list(range(targets))  # each target exactly once
    assert set(plan) == set(range(paired))  # only the first min() send
    assert all(plan[s][0] == s for s in plan)  # the one-to-one prefix
    loads = [len(ts) for ts in plan.values()]
    assert max(loads) - min(loads) <= 1  # spread evenly


def test_plan_rejects_empty_fleets():
    with pytest.raises(ValueError):
        plan_transfers(0, 3)


def test_format_plan_lists_idle_sources():
    text = format_plan(plan_transfers(4, 1), 4)
    assert "source 0 -> engines [0]" in text and "idle sources: [1, 2, 3]" in text
