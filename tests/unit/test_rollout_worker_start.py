"""A rollout worker's start-up imports (torch, the engine) leave its event loop free: the loop sends the
heartbeats, and a loaded machine can stretch those imports past the heartbeat time-out."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles.workers import rollout_worker


def test_start_imports_off_the_event_loop(monkeypatch) -> None:
    def slow_import(kind: str) -> None:  # an import that holds its thread for half a second, then stops the start
        time.sleep(0.5)
        raise RuntimeError(f"stop after importing for {kind}")

    monkeypatch.setattr(rollout_worker, "_import_engine_modules", slow_import)
    worker = rollout_worker.RolloutWorker.__new__(rollout_worker.RolloutWorker)
    worker.kind = "embedded"

    async def main() -> int:
        ticks = 0

        async def tick() -> None:  # stands in for the heartbeat task
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.get_running_loop().create_task(tick())
        with pytest.raises(RuntimeError, match="stop after importing for embedded"):
            await worker.on_start()
        task.cancel()
        return ticks

    assert asyncio.run(main()) >= 2, "the event loop did not run while the worker imported"
