"""Start `launch/torchrun_multi_node.sh` on every namespace host and read what the run left."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from netns_hosts import Host

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "torchrun_multi_node.sh"
DEMO = REPO / "launch" / "configs" / "demo_cpu.yaml"
# Two trainer ranks, one per host (the engine stays on node 0), a small deterministic batch.
TWO_NODE_DEMO = [
    "--config",
    str(DEMO),
    "--no-progress-bar",
    "--deterministic",
    "--rollout-batch-size",
    "8",
    "--n-samples-per-prompt",
    "8",
    "--global-batch-size",
    "64",
    "--lr",
    "0.03",
    "--eval-interval",
    "none",
    "--actor-num-nodes",
    "2",
    "--actor-num-gpus-per-node",
    "1",
]


def job_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "MILES_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MILES_PYTHON": sys.executable,
        **extra,
    }
    env.pop("MILES_RUN_SECRET", None)  # node 0 hands a fresh secret to node 1 through torchrun's store
    return env


@dataclasses.dataclass
class NodeRun:
    host: Host
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_torchrun(hosts: list[Host], out_dir: Path, flags: list[str], env: dict[str, str]) -> list[NodeRun]:
    """`torchrun --nnodes N` on every host, node 0 on hosts[0] and reached by its address."""
    # below the kernel's ephemeral range (32768-60999 by default), which the nodes' own client sockets draw from: a
    # port there was once taken by one of them (EADDRINUSE at torchrun's store); a new one per run skips TIME_WAIT
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    port = random.randint(20000, min(low, 32768) - 1)
    runs = []
    for rank, host in enumerate(hosts):
        log = out_dir.parent / f"{out_dir.name}-node{rank}.log"
        with open(log, "ab") as f:
            proc = host.popen(
                ["bash", str(SCRIPT), str(len(hosts)), str(rank), hosts[0].addr, *flags, "--output-dir", str(out_dir)],
                cwd=REPO,
                env={**env, "MASTER_PORT": str(port)},
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        runs.append(NodeRun(host, proc, log))
    return runs


def wait_all(runs: list[NodeRun], timeout_s: float) -> list[int | None]:
    """Exit codes once every node's launcher ended, or None for those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(r.proc.poll() is None for r in runs):
        time.sleep(0.2)
    return [r.proc.poll() for r in runs]


def outputs(runs: list[NodeRun]) -> str:
    return "\n".join(f"===== node {i} ({r.host.name})\n{r.output()[-6000:]}" for i, r in enumerate(runs))


def train_rows(out_dir: Path) -> list[dict]:
    """metrics.jsonl rows of trained steps (a line still being written is skipped)."""
    path = out_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "train/loss" in row:
            rows.append(row)
    return rows


def wait_for_step(out_dir: Path, step: int, runs: list[NodeRun], timeout_s: float) -> None:
    """Until step ``step`` is in metrics.jsonl; fails with the nodes' output if a node ends first."""
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in train_rows(out_dir)):
        ended = [r.proc.poll() for r in runs]
        assert all(c is None for c in ended), f"a node ended before step {step}: {ended}\n{outputs(runs)}"
        assert time.monotonic() < deadline, f"step {step} not reached in {timeout_s:.0f} s\n{outputs(runs)}"
        time.sleep(0.2)
