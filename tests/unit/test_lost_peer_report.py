"""On several nodes a worker's error that echoes a lost peer is reported as that peer's death."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from miles.controller.run import MilesRun
from miles.wire.rpc import RemoteError
from miles.wire.specs import WorkerDied

RESET = RemoteError("trainer:0", "train", "RuntimeError", "Read error [10.0.0.2]:4242: Connection reset by peer", "")
LOST = WorkerDied("agent", 1, 77, None, None, "", reason="hung: no heartbeat for 20.0 s", node=1)


def _run(num_nodes: int, verdict: BaseException | None, heartbeat_timeout_s: float = 5.0) -> SimpleNamespace:
    async def wait_failure() -> BaseException:
        if verdict is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(0.01)  # the heartbeat verdict comes after the collective's error
        return verdict

    runtime = SimpleNamespace(num_nodes=num_nodes, wait_failure=wait_failure)
    cfg = SimpleNamespace(runtime=SimpleNamespace(heartbeat_timeout_s=heartbeat_timeout_s, heartbeat_interval_s=0.01))
    return SimpleNamespace(runtime=runtime, cfg=cfg)


def _lost(run: SimpleNamespace, exc: BaseException | None) -> WorkerDied | None:
    return asyncio.run(MilesRun._lost_peer_behind(run, exc))


def test_a_collective_error_on_several_nodes_reports_the_lost_peer() -> None:
    assert _lost(_run(2, LOST), RESET) is LOST


def test_the_worker_error_stands_when_every_peer_answers() -> None:
    assert _lost(_run(2, None, heartbeat_timeout_s=0.05), RESET) is None


def test_one_node_and_other_errors_are_not_held_back() -> None:
    assert _lost(_run(1, LOST), RESET) is None  # one node: no peer elsewhere to wait for
    assert _lost(_run(2, LOST), ValueError("bad flag")) is None  # not a worker's error
    assert _lost(_run(2, LOST), None) is None  # the run ended cleanly
    nan = RemoteError("trainer:0", "train", "NonFiniteTraining", "loss is NaN", "")
    assert _lost(_run(2, LOST), nan) is None  # a known run failure is its own cause
    assert _lost(_run(2, RuntimeError("interrupted")), RESET) is None  # only a dead or hung peer replaces it
