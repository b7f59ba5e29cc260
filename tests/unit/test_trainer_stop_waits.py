"""A trainer stopping (SIGTERM: the worker's orderly shutdown) lets a background checkpoint write finish."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from miles.workers.base import Worker
from miles.workers.trainer_worker import TrainerWorker


def test_on_stop_returns_only_after_the_background_write():
    done = threading.Event()
    writer = threading.Thread(target=lambda: (time.sleep(0.3), done.set()))
    writer.start()
    worker = SimpleNamespace(backend=SimpleNamespace(finish_saves_local=writer.join))
    asyncio.run(TrainerWorker.on_stop(worker))
    assert done.is_set()


def test_the_worker_host_gives_a_trainer_time_for_a_large_write():
    assert TrainerWorker.stop_timeout_s > Worker.stop_timeout_s
