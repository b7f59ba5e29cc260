"""`python -m miles.launch --selftest`: node 0 spawns no-op workers on every node, calls each, reports."""

from __future__ import annotations

import time
from typing import Any

from miles.controller.runtime import Runtime
from miles.wire.launch_env import LaunchEnv, heartbeat_settings, runtime_options
from miles.wire.specs import WorkerSpec

NOOP_ENTRY = "miles.testing.noop:NoopWorker"


async def run_selftest(le: LaunchEnv, workers_per_node: int, run_dir: str) -> dict[str, Any]:
    """Start `workers_per_node` no-op workers on each of the job's nodes; a summary of who answered."""
    options = runtime_options(le)
    specs = [
        WorkerSpec("noop", node * workers_per_node + i, NOOP_ENTRY, node=node)
        for node in range(le.num_nodes)
        for i in range(workers_per_node)
    ]
    t0 = time.perf_counter()
    async with await Runtime.start(specs, run_dir=run_dir, **options, **heartbeat_settings()) as rt:
        startup_s = time.perf_counter() - t0
        infos = await rt.call_all("noop", "whoami", timeout_s=60)
        echoed = await rt.call_all("noop", "echo", "ping", timeout_s=60)
    per_node: dict[int, list[int]] = {}
    for info in infos:
        per_node.setdefault(info["node"], []).append(info["pid"])
    return {
        "selftest": "ok" if all(e == "ping" for e in echoed) else "failed",
        "num_nodes": le.num_nodes,
        "workers": len(infos),
        "workers_per_node": {str(k): len(v) for k, v in sorted(per_node.items())},
        "startup_s": round(startup_s, 3),
        "transport": options["transport"],
    }
