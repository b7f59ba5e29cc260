"""Graceful stop: SIGTERM / SIGUSR1 (Slurm's pre-timeout signal) / SIGINT end the run at the next
step boundary after a checkpoint (when `--save` is set), so a requeued job resumes where this one
stopped. Without `--save` the run stops at the step boundary and says that nothing is saved.

A signal during training or a weight push lets that step finish. A signal while the step's
rollout is still generating abandons the rollout at once (`StopRequested`; its prompts go back to
the data source) and the last finished step is the boundary: generation may never finish (every
group dropped) or take longer than a scheduler's grace period. A second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
import signal

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequested(Exception):
    """Raised by a wait that a stop signal interrupts (the rollout); the loop ends at the last finished step."""


class StopRequest:
    def __init__(self, *, saves: bool = True) -> None:
        self.saves = saves  # whether the run checkpoints before it stops (it has --save)
        self.signal: int | None = None
        self.event: asyncio.Event | None = None  # set by the first signal, for waits that race it
        self._installed: list[int] = []

    def install(self) -> StopRequest:
        loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        for sig in STOP_SIGNALS:
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform without signals
                pass
        return self

    def _on_signal(self, sig: int) -> None:
        if self.signal is not None:  # a second signal: stop now (workers are torn down on the way out)
            raise KeyboardInterrupt
        self.signal = sig
        if self.event is not None:
            self.event.set()
        name = signal.Signals(sig).name
        if self.saves:
            logger.warning("received %s: checkpointing at the end of this step, then exiting", name)
        else:
            logger.warning("received %s: no --save: stopping at the end of this step without a checkpoint", name)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()
