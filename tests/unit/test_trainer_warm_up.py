"""The trainer sets up at process start (warm_up); the controller's `setup` call collects that result."""

from __future__ import annotations

import logging

import pytest

from miles.workers.base import WorkerContext
from miles.workers.trainer_worker import TrainerWorker

SECTIONS = {name: {} for name in ("model", "train", "algo", "rollout", "weights")}


def make_worker(monkeypatch, outcome) -> tuple[TrainerWorker, list[int]]:
    ctx = WorkerContext("trainer", 0, ".", 0, {}, logging.getLogger("test"))
    worker = TrainerWorker(ctx, sections=SECTIONS)
    calls: list[int] = []

    def fake_setup() -> dict:
        calls.append(1)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(worker, "_setup", fake_setup)
    return worker, calls


def test_setup_after_warm_up_returns_its_result_without_building_again(monkeypatch) -> None:
    worker, calls = make_worker(monkeypatch, {"rank": 0, "world_size": 1})
    worker.warm_up()
    assert worker.setup() == {"rank": 0, "world_size": 1}
    assert calls == [1]


def test_setup_without_warm_up_builds_once(monkeypatch) -> None:
    worker, calls = make_worker(monkeypatch, {"rank": 0, "world_size": 1})
    worker.setup()
    worker.setup()
    assert calls == [1]


def test_a_failed_warm_up_is_raised_by_setup(monkeypatch) -> None:
    worker, calls = make_worker(monkeypatch, ValueError("no such checkpoint"))
    with pytest.raises(ValueError, match="no such checkpoint"):
        worker.warm_up()
    with pytest.raises(ValueError, match="no such checkpoint"):
        worker.setup()
    assert calls == [1]
