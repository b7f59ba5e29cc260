"""A worker that does (almost) nothing: the runtime's tests, the launch self-test and the RPC bench use it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

from miles.workers.base import Worker, WorkerContext


class NoopWorker(Worker):
    def __init__(
        self,
        ctx: WorkerContext,
        *,
        tag: str = "",
        fail_in_init: bool = False,
        init_sleep_s: float = 0.0,
        warm_up_s: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        time.sleep(init_sleep_s)  # stands in for a slow model load
        self.warm_up_s = warm_up_s
        self.warmed_up = False
        if fail_in_init:
            raise ValueError(f"NoopWorker {ctx.name} was asked to fail in __init__ (tag={tag!r})")
        self.tag = tag
        self._children: list[subprocess.Popen] = []

    def warm_up(self) -> None:
        time.sleep(self.warm_up_s)  # stands in for a set-up begun before any call
        self.warmed_up = True

    async def is_warm(self) -> bool:
        """On the event loop: answers while warm_up still runs."""
        return self.warmed_up

    def is_warm_sync(self) -> bool:
        """On the sync thread: queued behind warm_up."""
        return self.warmed_up

    async def noop(self) -> None:
        """Runs on the event loop: the cheapest possible round trip."""

    async def echo(self, value: Any) -> Any:
        return value

    async def sink(self, value: Any) -> None:
        """Takes an argument (e.g. a tensor) and answers nothing: one-way payload cost."""

    def echo_sync(self, value: Any) -> Any:
        """Same as echo, through the worker's thread pool."""
        return value

    def get_tag(self) -> str:
        return self.tag

    async def sleep(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    def sleep_sync(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    async def block_loop(self, seconds: float) -> None:
        """Blocks the event loop (no heartbeats): simulates a hung worker."""
        time.sleep(seconds)

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def spawn_grandchild(self) -> int:
        """Start a long sleeper in a new session; teardown must still end it."""
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        self._children.append(child)
        return child.pid
