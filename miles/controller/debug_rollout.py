"""The rollout side of the debug modes, behind the same `generate(rollout_id)` the sync loop calls.

- `--load-debug-rollout-data` (implies `--debug-train-only`): `SavedRollouts` reads each step's
  saved rollout instead of generating; no engine is started.
- `--save-debug-rollout-data`: `SavingRollouts` writes each step's rollout after it is generated,
  in a normal run or with `--debug-rollout-only`.
File reads and writes go to a thread: the event loop keeps serving heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from miles.config import RuntimeConfig
from miles.controller.preflight import PreflightError
from miles.controller.rollout_manager import RolloutResult
from miles.rollout.debug_data import debug_rollout_path, load_debug_rollout, save_debug_rollout

logger = logging.getLogger(__name__)


class RolloutSource(Protocol):
    """What the sync loop draws each step's groups from (SyncRolloutManager, or a debug source)."""

    async def generate(self, rollout_id: int) -> RolloutResult: ...


class SavedRollouts:
    """Rollouts replayed from `--load-debug-rollout-data`: the groups and metrics saved for each step."""

    def __init__(self, template: str, first_rollout_id: int) -> None:
        self.template = template
        first = debug_rollout_path(template, first_rollout_id)
        try:
            open(first, "rb").close()
        except OSError as e:
            raise PreflightError(
                f"--load-debug-rollout-data: cannot read the rollout of the first step "
                f"({first_rollout_id}) at {first}: {e.strerror}; save it with "
                "--save-debug-rollout-data or --debug-rollout-only first"
            ) from None

    async def generate(self, rollout_id: int) -> RolloutResult:
        groups, metrics = await asyncio.to_thread(load_debug_rollout, self.template, rollout_id)
        return RolloutResult(groups=groups, metrics=metrics)


class SavingRollouts:
    """Any rollout source, with each step's result also written to `--save-debug-rollout-data`."""

    def __init__(self, inner: RolloutSource, template: str) -> None:
        self.inner = inner
        self.template = template

    async def generate(self, rollout_id: int) -> RolloutResult:
        result = await self.inner.generate(rollout_id)
        path = await asyncio.to_thread(save_debug_rollout, self.template, rollout_id, result.groups, result.metrics)
        logger.info("saved the rollout of step %d to %s", rollout_id, path)
        return result


def debug_rollouts(
    runtime_cfg: RuntimeConfig, start_rollout_id: int, make_manager: Callable[[], RolloutSource]
) -> RolloutSource:
    """The loop's rollout source: saved rollouts under `--load-debug-rollout-data`, else `make_manager()`;
    wrapped to save every step under `--save-debug-rollout-data`."""
    if runtime_cfg.load_debug_rollout_data:
        source = SavedRollouts(runtime_cfg.load_debug_rollout_data, start_rollout_id)
    else:
        source = make_manager()
    if runtime_cfg.save_debug_rollout_data:
        source = SavingRollouts(source, runtime_cfg.save_debug_rollout_data)
    return source
