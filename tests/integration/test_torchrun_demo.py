"""The CPU demo as two torchrun "nodes" on one machine (launch/torchrun_multi_node.sh).

actor_num_nodes=2 with one rank per node: trainer rank 1 is placed on node 1, so the node-1 agent
must spawn it and the FSDP world (gloo) really spans both launchers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import psutil
import pytest

from harness import SMALL_RUN, free_port_run  # isort: skip

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "launch", "torchrun_multi_node.sh")
TINY = [
    "--config",
    "launch/configs/demo_cpu.yaml",
    "--num-rollout",
    "3",
    *SMALL_RUN,
    "--actor-num-nodes",
    "2",
    "--actor-num-gpus-per-node",
    "1",
]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_demo_trains_across_two_torchrun_nodes(tmp_path) -> None:
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MILES_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MASTER_PORT": str(free_port_run(3)),  # torchrun's store, the controller, the trainers' rendezvous
        "MILES_HEARTBEAT_TIMEOUT_S": "60",
    }
    env.pop("MILES_RUN_SECRET", None)  # node 0 hands a fresh secret to node 1 through torchrun's store
    procs = [
        subprocess.Popen(
            ["bash", SCRIPT, "2", str(node), "127.0.0.1", *TINY, "--output-dir", str(run_dir)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=400)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    joined = "\n===== node 1 =====\n".join(o[-5000:] for o in outputs)
    assert [p.returncode for p in procs] == [0, 0], joined

    # node 1's agent spawned trainer rank 1, and that rank trained in a 2-rank world
    assert "node 1: spawned ['trainer:1']" in outputs[1], joined
    trainer1_log = (run_dir / "logs" / "trainer_1.log").read_text()
    assert "dp=2" in trainer1_log, trainer1_log[-3000:]
    assert sorted(os.listdir(run_dir / "logs")) == ["rollout_0.log", "trainer_0.log", "trainer_1.log"]

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "train/loss" in m] == [0, 1, 2]
    assert all(m["rollout/weight_version"] == m["step"] + 1 for m in steps if "train/loss" in m)
    leftover = [
        p for p in psutil.process_iter(["cmdline", "environ"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert leftover == [], f"processes left behind: {leftover}"
