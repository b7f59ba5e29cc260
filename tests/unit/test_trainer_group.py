"""`TrainerGroup` calls TrainerWorker methods by their real names and signatures, on every rank."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest

from miles.controller.trainers import TrainerGroup
from miles.rollout.train_data import TrainBatch
from miles.trainer.checkpoint import CheckpointWriteError
from miles.wire.rpc import RemoteError
from miles.workers.trainer_worker import TrainerWorker


class Rank:
    """A trainer rank that checks each call against TrainerWorker's method of that name, then records it."""

    def __init__(self, rank: int, calls: list, fail: Exception | None = None) -> None:
        self.rank, self.calls, self.fail = rank, calls, fail

    async def call(self, method: str, *args, timeout_s=None, **kwargs):
        assert not method.startswith("_")
        inspect.signature(getattr(TrainerWorker, method)).bind(None, *args, **kwargs)
        self.calls.append((self.rank, method, args, kwargs, timeout_s))
        if self.fail is not None:
            raise self.fail
        return {"rank": self.rank}


class Runtime:
    def __init__(self, size: int, fail: Exception | None = None) -> None:
        self.calls: list = []
        self.ranks = [Rank(r, self.calls, fail) for r in range(size)]

    def workers(self, role: str) -> list[Rank]:
        assert role == "trainer"
        return self.ranks

    async def call_all(self, role: str, method: str, *args, timeout_s=None, **kwargs) -> list:
        return list(
            await asyncio.gather(*(r.call(method, *args, timeout_s=timeout_s, **kwargs) for r in self.workers(role)))
        )


def _batch(n: int) -> TrainBatch:
    """n samples of 3 tokens, one of them the response."""
    ones, zeros = np.ones(n, np.int64), np.zeros(n, np.int64)
    return TrainBatch(
        tokens=np.arange(3 * n, dtype=np.int64),
        seq_lens=3 * ones,
        response_lengths=ones,
        loss_masks=np.ones(n, np.float32),
        rewards=np.zeros(n, np.float32),
        raw_rewards=np.zeros(n, np.float32),
        group_index=zeros,
        sample_index=np.arange(n),
        truncated=np.zeros(n, np.int8),
    )


def test_every_method_reaches_every_rank_with_trainer_worker_signatures() -> None:
    rt = Runtime(2)
    group = TrainerGroup(rt)

    async def main() -> tuple:
        await group.setup()
        await group.memory_plan()
        await group.connect_engines(["http://e"], colocated=False, keep_weight_mapping=True)
        pushed = await group.push_weights(3, timeout_s=9.0)
        trained = await group.train(5, [_batch(1), _batch(2)])
        await group.save("/ckpt/iter_0000005", {"rollout_id": 5})
        loaded = await group.load("/ckpt/iter_0000005")
        await group.export_hf("/hf")
        await group.offload()
        await group.onload()
        await group.close_weights()
        return pushed, trained, loaded

    assert asyncio.run(main()) == ({"rank": 0}, {"rank": 0}, {"rank": 0})  # rank 0 speaks for the group
    methods = [m for _, m, *_ in rt.calls]
    for name in (
        "setup",
        "memory_plan",
        "connect_engines",
        "push_weights",
        "train",
        "save",
        "load",
        "export_hf",
        "offload",
        "onload",
        "close_weights",
    ):
        assert methods.count(name) == 2, name
    trains = {rank: args for rank, m, args, _, _ in rt.calls if m == "train"}
    assert [len(TrainBatch.from_dict(trains[r][0])) for r in (0, 1)] == [1, 2]  # shard i on rank i
    assert {t for _, m, _, _, t in rt.calls if m == "push_weights"} == {9.0}
    # the transfer mode travels once, in each rank's config at spawn: connect_engines does not send it again
    assert all("mode" not in kw for _, m, _, kw, _ in rt.calls if m == "connect_engines")


def test_a_failed_checkpoint_write_is_its_one_line_reason() -> None:
    reason = "disk full (ENOSPC) while saving checkpoint /c/iter_0000000; free space or point --save elsewhere"
    remote = RemoteError("trainer:0", "save", "CheckpointWriteError", reason, "Traceback ...")
    with pytest.raises(CheckpointWriteError) as info:
        asyncio.run(TrainerGroup(Runtime(1, fail=remote)).save("/c/iter_0000000", {}))
    assert str(info.value) == reason
    other = RemoteError("trainer:0", "save", "ValueError", "something else", "tb")
    with pytest.raises(RemoteError):
        asyncio.run(TrainerGroup(Runtime(1, fail=other)).save("/c/iter_0000000", {}))


def test_an_empty_group_calls_no_rank_and_returns_nothing() -> None:
    """A run without trainer (--debug-rollout-only): every call is a no-op, no metrics, no resume state."""
    rt = Runtime(2)
    group = TrainerGroup(rt, empty=True)

    async def main() -> tuple:
        await group.setup()
        await group.offload()
        await group.close_weights()
        return await group.push_weights(1, timeout_s=1.0), await group.train(0, []), await group.load("/c")

    assert asyncio.run(main()) == ({}, {}, {})
    assert rt.calls == [] and not group and group.size == 0
    assert TrainerGroup(rt) and TrainerGroup(rt).size == 2
