"""`torchrun --nnodes 2` across two namespace hosts: separate network stacks, one bridge between them.

The launcher runs on each host (launch/torchrun_multi_node.sh); node 1 reaches node 0 only by its
address on the bridge (each host has its own loopback), so the rendezvous, the run secret, the
controller's TCP + HMAC frames and the trainers' gloo world all cross a real interface.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time

import pytest
from multihost_run import TWO_NODE_DEMO, job_env, outputs, start_torchrun, train_rows, wait_all
from netns_hosts import SUBNET

pytestmark = [
    pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH"),
    pytest.mark.exec_workers,  # the hosts are network namespaces: no fork server there
]

PY_CONNECT = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3); "
    "print(s.getsockname()[0]); s.close()"
)
PY_LISTEN = (
    "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('0.0.0.0', 29999)); s.listen(); print('up', flush=True); c, a = s.accept(); print(a[0], flush=True)"
)


def test_hosts_reach_each_other_and_nothing_else(hosts) -> None:
    h0, h1 = hosts
    listener = h0.popen([sys.executable, "-c", PY_LISTEN], stdout=-1, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        out = h1.run([sys.executable, "-c", PY_CONNECT, h0.addr, "29999"])
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == h1.addr  # h1 left by its own address...
        assert listener.stdout.readline().strip() == h1.addr  # ...and h0 saw that address
    finally:
        listener.kill()
        listener.wait()
    # each host has its own loopback: h0's listener is not on h1's 127.0.0.1
    assert h1.run([sys.executable, "-c", PY_CONNECT, "127.0.0.1", "29999"]).returncode != 0
    # the only route is the private /24: nothing can leave the group
    routes = h0.run(["ip", "route", "show", "table", "all"]).stdout
    assert "default" not in routes and f"{SUBNET}.0/24 dev eth0" in routes
    # the hosts file names every host, and the node's own hostname is its address
    assert h1.run(["getent", "hosts", "h0"]).stdout.split()[0] == h0.addr
    assert h1.run(["hostname"]).stdout.strip() == "h1"
    sleeper = h1.popen(["sleep", "600"])
    deadline = time.monotonic() + 10  # nsenter enters the namespace, then execs `sleep`
    while sleeper.pid not in h1.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleeper.pid in h1.pids() and sleeper.pid not in h0.pids()
    assert sleeper.pid in h1.kill_all()
    sleeper.wait()
    assert h1.pids() == []


def test_demo_learns_across_two_hosts(hosts, tmp_path) -> None:
    """Trainer rank 1 on host 1, trainer rank 0 and the engine on host 0; the reward rises."""
    h0, h1 = hosts
    out_dir = tmp_path / "run"
    steps = 10
    flags = [*TWO_NODE_DEMO, "--num-rollout", str(steps), "--controller-host", h0.addr]
    started = time.monotonic()
    runs = start_torchrun(hosts, out_dir, flags, job_env(MILES_HEARTBEAT_TIMEOUT_S="60"))
    codes = wait_all(runs, timeout_s=400)
    wall_s = time.monotonic() - started
    text = outputs(runs)
    assert codes == [0, 0], text
    node0, node1 = runs[0].output(), runs[1].output()

    # the controller listened on host 0's address and node 1 dialled that address, not a loopback one
    port = re.search(r"runtime \w+ listening on tcp://([\d.]+):(\d+)", node0)
    assert port is not None and port.group(1) == h0.addr, text
    assert f"launch on h1: node 1 of 2, controller {h0.addr}:{port.group(2)}" in node1, text
    assert "127.0.0.1" not in "\n".join(line for line in node1.splitlines() if "controller" in line)

    # node 1's agent spawned trainer rank 1, which trained in a 2-rank gloo world; the engine is node 0's
    assert "node 1: spawned ['trainer:1']" in node1, text
    assert "spawned trainer:0" in node0 and "spawned rollout:0" in node0, text
    for peer, host in (("trainer:0", "h0"), ("rollout:0", "h0"), ("agent:1", "h1"), ("trainer:1", "h1")):
        assert f"{peer} registered from host {host} (node {host[1]})" in node0, text
    assert sorted(os.listdir(out_dir / "logs")) == ["rollout_0.log", "trainer_0.log", "trainer_1.log"]
    assert "dp=2" in (out_dir / "logs" / "trainer_1.log").read_text()

    rows = train_rows(out_dir)
    assert [r["step"] for r in rows] == list(range(steps))
    reward = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last - first >= 0.1, f"the reward did not rise: {reward}"
    assert h0.pids() == [] and h1.pids() == [], "processes left on the hosts after the run"
    print(f"two-host demo: {steps} steps in {wall_s:.1f} s, reward {first:.3f} -> {last:.3f}")
