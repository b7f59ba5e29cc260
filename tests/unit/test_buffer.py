"""The fully async data buffer: drops on arrival and on the way out, capacity, metrics, pace estimate."""

from __future__ import annotations

import asyncio

import pytest

from miles.controller.async_producer import GroupLedger, staleness_at_take
from miles.controller.buffer import BufferConfig, DataBuffer, group_staleness
from miles.rollout.sample import Sample, SampleStatus


def _group(index: int, versions: list[list[int]], status: SampleStatus = SampleStatus.COMPLETED) -> list[Sample]:
    return [
        Sample(
            group_index=index,
            index=index * 10 + i,
            weight_versions=list(v),
            status=status,
            response_length=len(v),
            reward=float(i),
        )
        for i, v in enumerate(versions)
    ]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, group, reason: str) -> None:
        self.calls.append((group[0].group_index, reason))


def _buffer(capacity=4, max_staleness=None, steps=1, filter_fn=None):
    rec = Recorder()
    buf = DataBuffer(BufferConfig(capacity, max_staleness, steps), unused_handler=rec, filter_fn=filter_fn)
    return buf, rec


def test_staleness_is_current_minus_oldest_token_of_any_sample() -> None:
    g = _group(0, [[3, 4, 5], [5, 5], [2, 6]])
    assert group_staleness(g, 7) == 5  # oldest token: version 2
    assert group_staleness(g, 7, steps_per_version=2) == 10
    assert group_staleness(_group(1, [[], []]), 7) is None


def test_aborted_dropped_on_arrival_and_filter_rejected_reported_as_filtered() -> None:
    async def main():
        reject_index = 2
        buf, rec = _buffer(filter_fn=lambda g: (g[0].group_index != reject_index, "zero_std"))
        assert not await buf.put(_group(1, [[0], [0]], status=SampleStatus.ABORTED))
        assert not await buf.put(_group(reject_index, [[0], [0]]))
        assert await buf.put(_group(3, [[0], [0]]))
        assert len(buf) == 1
        assert rec.calls == [(1, "aborted"), (reject_index, "filtered")]
        m = buf.metrics()
        assert m["rollout/fully_async/aborted_groups_filtered"] == 1
        assert m["rollout/fully_async/filter_rejected_groups"] == 1

    asyncio.run(main())


def test_stale_groups_dropped_at_take_not_at_put() -> None:
    async def main():
        buf, rec = _buffer(capacity=8, max_staleness=1)
        for i, v in enumerate([0, 1, 2, 2]):
            assert await buf.put(_group(i, [[v, v + 1], [v + 1]]))  # every group accepted on arrival
        taken = await buf.take(2, current_version=2)
        assert [g[0].group_index for g in taken] == [1, 2]  # group 0 (staleness 2) dropped on the way out
        assert rec.calls == [(0, "stale")]
        m = buf.metrics()
        assert m["rollout/fully_async/stale_groups_filtered"] == 1
        assert m["rollout/fully_async/queue_size"] == 4
        assert m["rollout/fully_async/avg_staleness"] == pytest.approx(0.5)  # staleness 1 and 0
        assert m["rollout/fully_async/max_staleness"] == 1
        assert m["rollout/fully_async/buffer_avg_staleness"] == 0  # group 3 still waits, staleness 0
        again = buf.metrics()  # the window resets after each report
        assert again["rollout/fully_async/stale_groups_filtered"] == 0

    asyncio.run(main())


def test_put_blocks_when_full_until_take() -> None:
    async def main():
        buf, _ = _buffer(capacity=2)
        await buf.put(_group(0, [[0]]))
        await buf.put(_group(1, [[0]]))
        blocked = asyncio.create_task(buf.put(_group(2, [[0]])))
        await asyncio.sleep(0.05)
        assert not blocked.done() and len(buf) == 2
        await buf.take(1, current_version=0)
        assert await asyncio.wait_for(blocked, 1.0)
        assert len(buf) == 2

    asyncio.run(main())


def test_take_waits_for_enough_groups() -> None:
    async def main():
        buf, _ = _buffer()
        take = asyncio.create_task(buf.take(2, current_version=0))
        await buf.put(_group(0, [[0]]))
        await asyncio.sleep(0.02)
        assert not take.done()
        await buf.put(_group(1, [[0]]))
        assert len(await asyncio.wait_for(take, 1.0)) == 2

    asyncio.run(main())


def test_zero_capacity_is_refused_with_the_flag_to_fix() -> None:
    with pytest.raises(ValueError, match="async-data-buffer-capacity-factor"):
        _buffer(capacity=0)


@pytest.mark.parametrize(
    ("position", "waiting", "expected"),
    [
        (0, True, 0),
        (3, True, 0),
        (4, True, 1),
        (8, True, 2),  # a waiting trainer takes positions 0..3 now
        (0, False, 1),
        (3, False, 1),
        (4, False, 2),  # a training trainer takes its next batch after its push
    ],
)
def test_pace_estimate(position: int, waiting: bool, expected: int) -> None:
    assert staleness_at_take(position, 4, trainer_waiting=waiting, steps_per_version=1) == expected
    assert staleness_at_take(position, 4, trainer_waiting=waiting, steps_per_version=3) == 3 * expected


def test_ledger_pending_prompts_are_reset_copies() -> None:
    ledger = GroupLedger()
    g0, g1 = _group(5, [[1, 2]]), _group(3, [[1]])
    ledger.add(g0)
    ledger.add(g1)
    ledger.resolve(g0)
    pending = ledger.pending_prompts()
    assert [[s["group_index"] for s in g] for g in pending] == [[3]]
    assert pending[0][0]["weight_versions"] == [] and pending[0][0]["response_length"] == 0
    assert g1[0].weight_versions == [1]  # the live group is untouched
